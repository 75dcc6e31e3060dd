#!/usr/bin/env python3
"""DataParallel ResNet training: one process drives every visible GPU; plain model on CPU.

Follows AIME "Multi GPU training with PyTorch", part 1 (DataParallel): global batch 64 split
over the GPUs, a checkpoint each epoch, reloaded at the start of the next. Without --data it
trains on synthetic in-memory images. For real multi-GPU speed use ddp_resnet.py.

    python dp_resnet.py                         # all visible GPUs, resnet50, global batch 64
    python dp_resnet.py --gpus 2 --data /path/to/train
    python dp_resnet.py --resume                # go on after model_checkpoints/epoch_N.pt
    python dp_resnet.py --cpu --arch resnet18 --image-size 64 --epochs 2 --max-steps 10
    python dp_resnet.py --no-wrap --batch-size 256 --epochs 1  # the baseline: bare model, cuda:0

The CPU example above prints where the model runs, a start line (`start | 1 process | CPU, no
DataParallel | resnet18 64px | ...`), `epoch 2/2 | step 10/10 | loss 7.0836 | 115 img/s` lines
(images/s after 5 warm-up steps an epoch; at least one every 30 s, with an eta), a line per
epoch and a final line:
    epoch 2/2 | loss 7.0261 | 115 img/s | 6.2 s
    done | epochs 2 | final_loss 7.0261 | 115 img/s | checkpoint model_checkpoints/epoch_2.pt
"""
import argparse
import errno
import fcntl
import hashlib
import io
import json
import os
import signal
import socket
import sys
import time
from itertools import islice
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while the slow imports below run: exit 130, no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(130))

import torch
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

# the two --arch models whose auxiliary heads would return tuples in training mode
AUX_OFF = {a: {"aux_logits": False, "init_weights": True} for a in ("googlenet", "inception_v3")}


class SyntheticImages(Dataset):
    """Images made once from the seed and kept as tensors (256 distinct ones, repeated): no
    decoding per sample, so images/s measures the model and not the CPU."""

    def __init__(self, size: int, image_size: int, num_classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(min(size, 256), 3, image_size, image_size, generator=g)
        self.labels = torch.randint(num_classes, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i % len(self.images)], self.labels[i]


def load_data(args: argparse.Namespace, pin_memory: bool, generator: torch.Generator):
    if args.data:
        transforms = T.Compose([
            T.Resize(round(args.image_size * 256 / 224)),  # the tutorial's 256 -> 224, any size
            T.CenterCrop(args.image_size),
            T.ToTensor(),
            T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ])
        # fixed: the tutorial's ImageFolder(root=, ...) is a syntax error
        dataset = torchvision.datasets.ImageFolder(args.data, transform=transforms)
    else:
        dataset = SyntheticImages(args.synthetic_size, args.image_size, args.num_classes, args.seed)
    # fixed: shuffle=False showed every epoch one order; the generator is reseeded each epoch,
    # as set_epoch does for DDP, so --resume sees the order an uninterrupted run sees.
    # fixed: 4 * num_gpus workers are none on a CPU machine. drop_last: a last batch of one
    # image would break BatchNorm.
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=True, generator=generator,
                      num_workers=args.workers, pin_memory=pin_memory, drop_last=True)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    # fixed: pretrained=False is deprecated; weights=None is the same random init
    return torchvision.models.get_model(args.arch, weights=None, num_classes=args.num_classes,
                                        **AUX_OFF.get(args.arch, {}))


class Bf16Autocast(torch.nn.Module):
    """--amp inside forward: DataParallel runs its replicas in threads, and autocast's dtype is
    per thread, so there they would autocast to fp16 (which needs a GradScaler), not bf16."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.model(x)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The torchvision model inside DataParallel and Bf16Autocast: its keys go into checkpoints."""
    model = model.module if isinstance(model, torch.nn.DataParallel) else model
    return model.model if isinstance(model, Bf16Autocast) else model


def save_model(epoch: int, model, optimizer, args: argparse.Namespace) -> Path:
    """Write epoch_N.pt and its sha256 (sha256sum's format) to temporary files, then rename
    both: a save that fails or is interrupted leaves the folder as it was."""
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"  # fixed: no file.touch(), torch.save makes it
    buffer = io.BytesIO()
    torch.save({"epoch": epoch, "model_state_dict": unwrap(model).state_dict(),  # no "module."
                "optimizer_state_dict": optimizer.state_dict(), "arch": args.arch,
                "num_classes": args.num_classes, "image_size": args.image_size}, buffer)
    sha256 = f"{hashlib.sha256(buffer.getvalue()).hexdigest()}  {file.name}\n".encode()
    try:
        write_atomic({file: buffer.getvalue(), file.with_name(file.name + ".sha256"): sha256})
    except OSError as e:  # a full disk, a read-only or vanished folder, an I/O error
        fix = "free some space" if e.errno == errno.ENOSPC else "fix that"
        sys.exit(f"error: cannot save {file} ({e.strerror or e}); earlier checkpoints are intact, "
                 f"{fix} and rerun with --resume")
    return file


def write_atomic(files: dict) -> None:
    """Each file to file.tmp first, then all renamed in order (the checkpoint before its sha256):
    never half a file under a real name, and no .tmp left when a write fails or is interrupted."""
    tmps = []
    try:
        for file, data in files.items():
            tmps.append(file.with_name(file.name + ".tmp"))
            with open(tmps[-1], "wb") as f:
                f.write(data)
                os.fsync(f.fileno())  # on disk before the rename publishes it
        for file, tmp in zip(files, tmps):
            os.replace(tmp, file)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


def load_model(device: torch.device, epoch: int, model, optimizer, args: argparse.Namespace):
    # One process, so no barrier: the save before this has returned. The weights go to the
    # device the model lives on (DataParallel copies them from there to every GPU each step).
    ckpt = read_checkpoint(Path(args.ckpt_dir) / f"epoch_{epoch}.pt", unwrap(model), args, device)
    optimizer.load_state_dict(ckpt["optimizer_state_dict"])


def read_checkpoint(file: Path, model, args: argparse.Namespace, map_location) -> dict:
    """Load file into model; whatever is wrong with it is one error line naming the file."""
    try:
        data = file.read_bytes()
        sha256 = file.with_name(file.name + ".sha256")
        if sha256.exists() and sha256.read_text().split()[:1] != [hashlib.sha256(data).hexdigest()]:
            raise ValueError(f"it does not match {sha256.name}: altered after it was written")
        ckpt = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)  # no code
        if ckpt.get("arch", args.arch) != args.arch:
            raise ValueError(f"it holds a {ckpt['arch']}, not --arch {args.arch}")
        model.load_state_dict(ckpt["model_state_dict"])
        return ckpt
    except Exception as e:  # unreadable, truncated, altered, not a checkpoint, another model
        reason = " ".join(str(e).split("WeightsUnpickler error:")[-1].split())[:150]
        sys.exit(f"error: cannot load checkpoint {file} ({type(e).__name__}: {reason}); "
                 f"delete it to go back one epoch, or use another --ckpt-dir")


def newest_checkpoint(folder: str) -> tuple:
    found = [(int(p.stem[6:]), p) for p in Path(folder).glob("epoch_*.pt") if p.stem[6:].isdigit()]
    return max(found, default=(0, None))


def run_training(gpus: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")  # DataParallel: from GPU 0
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(args.seed)
    model = build_model(args).to(device, memory_format=fmt)
    if gpus and not args.no_wrap:
        model = Bf16Autocast(model) if args.amp else model  # see Bf16Autocast
        model = torch.nn.parallel.DataParallel(model, device_ids=list(range(gpus)), dim=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    criterion = torch.nn.CrossEntropyLoss()
    generator = torch.Generator()
    dataloader = load_data(args, pin_memory=bool(gpus), generator=generator)
    torch.backends.cudnn.benchmark = True  # one input size: find the fastest kernels once
    steps = min(len(dataloader), args.max_steps or len(dataloader))
    progress, final_loss, checkpoint = Progress(args, device, steps), None, None
    progress.first_line(where(gpus, args), len(dataloader.dataset))  # what runs where
    model.train()
    for epoch in range(args.start_epoch, args.epochs + 1):  # fixed: range(1, 30) ran 29
        if epoch > 1:
            load_model(device, epoch - 1, model, optimizer, args)
        generator.manual_seed(args.seed + epoch)  # a new order each epoch, see load_data
        epoch_loss = torch.zeros((), device=device)
        for step, (images, labels) in enumerate(islice(dataloader, steps), 1):
            images = images.to(device, non_blocking=True, memory_format=fmt)
            labels = labels.to(device, non_blocking=True)
            # bf16 autocast needs no GradScaler; here it covers the loss (and the forward
            # without DataParallel); a CPU runs it slowly
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.detach()
            progress.step(epoch, step, loss, len(images))
        final_loss = epoch_loss.item() / steps
        checkpoint = save_model(epoch, model, optimizer, args)
        progress.summary(epoch, final_loss)
    report(args, gpus, progress, final_loss, checkpoint)


# --- plumbing: progress, checks, arguments ---
class Progress:
    """Rank 0's start line, then a line every --log-every steps and at least every 30 s, with
    images/s after the first --warmup-steps of each epoch (the loader starting again, cuDNN
    trying kernels) and the time the epoch has left. The clock is read after a device sync
    only for a line, so timing costs no speed."""

    def __init__(self, args: argparse.Namespace, device: torch.device, steps: int):
        self.args, self.device, self.steps = args, device, steps
        self.run, self.images, self.seconds = 0, 0, 0.0
        self.epoch_began = self.last_line = time.perf_counter()
        self.slow = device.type == "cpu" and args.image_size >= 160  # GPU sizes on a CPU

    def first_line(self, where: str, images: int) -> None:
        a, world = self.args, int(os.environ.get("WORLD_SIZE", "1"))
        print0(" | ".join([
            "start", where, f"{a.arch} {a.image_size}px",
            f"{a.data or 'synthetic'} {images} images",
            f"batch {a.batch_size}" + (f" x {world}" if world > 1 else ""),
            f"{self.steps} steps x {a.epochs} epochs", f"ckpt {a.ckpt_dir}",
            *([f"resumed from epoch {a.resumed_from}"] if a.resumed_from else [])]))
        if self.slow:
            print0(f"note: {a.arch} at {a.image_size}px is slow on a CPU (the eta below says how "
                   f"slow); for a quick look, as run_all.sh: --arch resnet18 --image-size 32 "
                   f"--batch-size 8 --epochs 2 --max-steps 3")

    def step(self, epoch: int, step: int, loss: torch.Tensor, batch: int) -> None:
        self.run += 1
        if step == self.args.warmup_steps:
            self.start = self.clock()
        elif step > self.args.warmup_steps:
            self.images += batch
        if (step % self.args.log_every == 0 or step == self.steps
                or time.perf_counter() - self.last_line >= 30):  # never quiet for long
            if step > self.args.warmup_steps:
                now = self.clock()
                self.seconds, self.start = self.seconds + now - self.start, now
            self.last_line = time.perf_counter()
            epoch_time = (self.last_line - self.epoch_began) * self.steps / step  # so far
            left = epoch_time * (1 - step / self.steps)
            eta = f" | eta {duration(left)}" if step < self.steps else ""
            print0(f"epoch {epoch}/{self.args.epochs} | step {step}/{self.steps} | "
                   f"loss {loss.item():.4f} | {self.per_sec()} img/s{eta}")
            if self.slow and step < self.steps:
                self.slow = False  # once
                print0(f"note: at this speed an epoch takes about {duration(epoch_time)}, all "
                       f"{self.args.epochs} epochs about {duration(epoch_time * self.args.epochs)}")

    def summary(self, epoch: int, loss: float, more: str = "") -> None:
        """The epoch's line: the mean loss of every rank's steps (and, say, top-1)."""
        now = time.perf_counter()
        seconds, self.epoch_began = now - self.epoch_began, now
        print0(f"epoch {epoch}/{self.args.epochs} | loss {loss:.4f}{more} | "
               f"{self.per_sec()} img/s | {seconds:.1f} s")

    def per_sec(self) -> str:
        rate = self.rate() * int(os.environ.get("WORLD_SIZE", "1"))  # rank 0's, times N
        return f"{rate:.0f}" if rate else "-"

    def rate(self) -> float:
        """This process's images/s so far."""
        return self.images / self.seconds if self.seconds else 0.0

    def clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the GPU runs ahead of Python
        return time.perf_counter()


def report(args, gpus: int, progress: Progress, final_loss, checkpoint) -> None:
    """The final line and the metrics JSON."""
    epochs, rate = len(range(args.start_epoch, args.epochs + 1)), progress.rate()
    loss = "-" if final_loss is None else f"{final_loss:.4f}"  # None: nothing left to train
    print0(f"done | epochs {epochs} | final_loss {loss} | {f'{rate:.0f}' if rate else '-'} img/s"
           f" | checkpoint {checkpoint or '-'}")
    if args.metrics_out:
        memory = max(map(torch.cuda.max_memory_allocated, range(gpus))) / 2**30 if gpus else None
        Path(args.metrics_out).write_text(json.dumps({
            "script": "dp_resnet.py", "world_size": gpus or 1, "backend": "none",
            "device": "cuda" if gpus else "cpu", "arch": args.arch,
            "wrapper": "DataParallel" if gpus and not args.no_wrap else None,
            "epochs_run": epochs, "steps": progress.run, "final_loss": final_loss,
            "images_per_sec": rate or None, "checkpoint": checkpoint and str(checkpoint),
            "max_memory_gib": memory, "resumed_from": args.resumed_from}, indent=1))


def where(gpus: int, args: argparse.Namespace) -> str:
    """What runs where, for the start line."""
    if gpus and not args.no_wrap:
        return f"1 process | DataParallel over {gpus} GPU(s)"
    return f"1 process | {'cuda:0' if gpus else 'CPU'}, no DataParallel"


def duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if days else f"{hours}h{minutes:02d}m" if hours else \
        f"{minutes}m{seconds:02d}s"


def print0(*args) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # global rank 0 (unset before setup: the parent)
        print(*args, flush=True)


def check_args(args: argparse.Namespace) -> int:
    """Refuse bad flags, data and checkpoints before training; return the GPUs to use."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))  # srun -n N starts N copies
    if tasks > 1:
        sys.exit(f"error: started as one of {tasks} SLURM tasks, each a training of its own; "
                 f"DataParallel is one process: srun -n 1 (README: On a SLURM cluster)")
    for name in ("epochs", "batch_size", "lr", "max_steps", "image_size", "num_classes",
                 "synthetic_size", "log_every", "warmup_steps", "gpus"):
        value = getattr(args, name)  # None: not given, a default applies
        if value is not None and value <= 0:
            sys.exit(f"error: --{name.replace('_', '-')} must be positive, got {value}")
    visible = 0 if args.cpu else torch.cuda.device_count()
    if (args.gpus or 0) > visible or (args.no_wrap and (args.gpus or 1) > 1):
        sys.exit(f"error: --gpus {args.gpus}, but {visible} GPU(s) visible"
                 f"{' and --no-wrap uses one' if args.no_wrap else ''}; leave --gpus out")
    try:  # the folder --metrics-out goes in, made now: no traceback after the training
        os.makedirs(os.path.dirname(os.path.abspath(args.metrics_out or "-")), exist_ok=True)
    except OSError as e:
        sys.exit(f"error: --metrics-out {args.metrics_out}: {e.strerror} ({e.filename})")
    gpus = min(1, visible) if args.no_wrap else args.gpus or visible
    # AIME's 4 loader workers per GPU decode images; in-memory synthetic ones need none
    check_resnet(args, world=1, workers=4 * gpus if args.data else 0)
    print0(f"DataParallel over {gpus} GPU(s), global batch {args.batch_size}"
           if gpus and not args.no_wrap else "--no-wrap: the plain model on cuda:0" if gpus else
           f"{'--cpu' if args.cpu else 'no GPU visible'}: the plain model on CPU (DataParallel "
           f"needs GPUs)")
    return gpus


def lock(folder: str):
    """Lock folder/.lock for the life of this process (the kernel lets go on any exit, SIGKILL
    too) and remove what a killed save left there; or return why not."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(folder) / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:  # a POSIX lock: the loader workers this process forks do not inherit it
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # another process holds it
            holder = os.read(fd, 100).decode(errors="replace").strip() or "pid unknown"
            if holder == f"host {socket.gethostname()}, pid {os.getppid()}":
                return None  # the launcher that spawned this rank: it holds it for the run
            return (f"error: --ckpt-dir {folder} is in use by another run ({holder}); wait for "
                    f"it to end, or use another folder")
        except OSError as e:  # a file system without locks (NFS without lockd, say)
            print(f"warning: cannot lock --ckpt-dir {folder} ({e.strerror}); make sure no other "
                  f"run uses it", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode())
        for left in Path(folder).glob("epoch_*.tmp*"):  # a killed save's: nobody else writes here
            left.unlink()
    except OSError as e:
        return f"error: cannot use --ckpt-dir {folder} ({e.strerror or e})"


def check_resnet(args: argparse.Namespace, world: int, workers: int) -> None:
    """Refuse a bad --arch, data or checkpoint before training; fill in what they decide."""
    if args.arch not in torchvision.models.list_models(module=torchvision.models):
        sys.exit(f"error: --arch {args.arch} is not a torchvision classification model; "
                 f"try resnet18 or resnet50")
    images, classes = args.synthetic_size, 1000
    if args.data:
        try:  # what ImageFolder would find, without a traceback in every rank
            names, index = find_classes(args.data)
            images, classes = len(make_dataset(args.data, index, IMG_EXTENSIONS)), len(names)
        except OSError as e:  # no folder, no class folders, a class folder without images
            sys.exit(f"error: --data {args.data}: {e.strerror or e}; an ImageFolder root holds "
                     f"one folder of images per class (leave --data out for synthetic images)")
        if (args.num_classes or classes) < classes:
            sys.exit(f"error: --num-classes {args.num_classes}, but --data has {classes} classes")
    args.num_classes = args.num_classes or classes
    if -(-images // world) < args.batch_size:  # each rank's share, padded by the sampler
        sys.exit(f"error: {images} images make no full batch of {args.batch_size} on each of "
                 f"{world} processes; lower --batch-size")
    args.workers = workers if args.workers is None else args.workers
    if args.workers < 0:
        sys.exit(f"error: --workers must be 0 or more, got {args.workers}")
    error = lock(args.ckpt_dir)  # held while this process lives
    if error:  # another run holds the folder: stop before any rank starts
        sys.exit(error)
    args.start_epoch, args.resumed_from = 1, None
    epoch, file = newest_checkpoint(args.ckpt_dir) if args.resume else (0, None)
    if args.resume and not file:
        print0(f"--resume: no checkpoint in {args.ckpt_dir}, starting fresh")
    elif file:
        read_checkpoint(file, build_model(args), args, "cpu")  # a bad one: one line, now
        args.start_epoch, args.resumed_from = epoch + 1, epoch
        print0(f"--resume: continuing after {file}, epochs {epoch + 1}..{args.epochs}" if epoch <
               args.epochs else f"--resume: {file} already reached --epochs {args.epochs}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpus", type=int, help="use the first N GPUs; default: all visible")
    p.add_argument("--cpu", action="store_true", help="the plain model on CPU even with GPUs")
    p.add_argument("--no-wrap", action="store_true", help="no DataParallel: the plain model on "
                   "one device, the benchmarks' baseline")
    p.add_argument("--epochs", type=int, default=30, help="train epochs 1..N")
    p.add_argument("--batch-size", type=int, default=64, help="global, split over the GPUs")
    p.add_argument("--lr", type=float, default=0.01, help="SGD, momentum 0.9, weight decay 1e-4")
    p.add_argument("--seed", type=int, default=0, help="model init, synthetic data, shuffling")
    p.add_argument("--max-steps", type=int, help="stop each epoch after N steps (smoke runs)")
    p.add_argument("--data", help="ImageFolder root; without it, synthetic in-memory images")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--arch", default="resnet50", help="any torchvision classification model")
    p.add_argument("--num-classes", type=int, help="default: --data's classes, or 1000")
    p.add_argument("--synthetic-size", type=int, default=12800, help="synthetic images an epoch")
    p.add_argument("--workers", type=int, help="loader processes; default: 4 per GPU with --data")
    p.add_argument("--amp", action="store_true", help="bf16 autocast (meant for GPUs)")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    p.add_argument("--ckpt-dir", default="model_checkpoints", help="where epoch_N.pt goes")
    p.add_argument("--resume", action="store_true", help="go on after --ckpt-dir's newest epoch")
    p.add_argument("--log-every", type=int, default=10, help="a progress line every N steps")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps an epoch left out of img/s")
    p.add_argument("--metrics-out", help="write the results here as JSON")
    return p.parse_args()


def interrupt(signum, frame) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # a second one must not cut the clean-up short
        signal.signal(s, lambda *_: None)
    raise KeyboardInterrupt


if __name__ == "__main__":
    args = parse_args()
    gpus = check_args(args)
    signal.signal(signal.SIGINT, interrupt)  # Ctrl-C or kill: end the step or save cleanly
    signal.signal(signal.SIGTERM, interrupt)
    try:
        run_training(gpus, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
