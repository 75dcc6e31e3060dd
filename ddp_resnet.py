#!/usr/bin/env python3
"""DistributedDataParallel ResNet training: rank 0 saves every epoch, every rank reloads it.

Follows AIME "Multi GPU training with PyTorch", part 2 (DistributedDataParallel), and the
official DDP tutorial's checkpoint section (rank 0 saves, dist.barrier(), every rank loads with
map_location). Without --data it trains on synthetic images held in memory.

    python ddp_resnet.py                        # one process per GPU: resnet50, batch 64 each
    python ddp_resnet.py --data /path/to/train  # any ImageFolder root
    python ddp_resnet.py --data train --val-data val  # top-1 on val after every epoch
    python ddp_resnet.py --resume               # go on after model_checkpoints/epoch_N.pt
    python ddp_resnet.py --cpu --arch resnet18 --image-size 64 --epochs 2 --max-steps 10
    torchrun --standalone --nproc-per-node=2 ddp_resnet.py --cpu ...   # the same flags work

The CPU example above prints, from rank 0, a start line (`start | 2 processes | gloo on CPU |
resnet18 64px | ...`), `epoch 2/2 | step 10/10 | loss 6.9155 | 110 img/s` lines (images/s of
all ranks, after 5 warm-up steps an epoch; at least one every 30 s, with an eta), a line per
epoch (its mean
loss over every rank's steps; with --val-data, `| val_accuracy 0.8552 (10000 images)` after
it) and a final line:
    epoch 2/2 | loss 6.9671 | 110 img/s | 12.3 s
    done | epochs 2 | final_loss 6.9671 | 110 img/s | checkpoint model_checkpoints/epoch_2.pt
"""
import argparse
import ctypes
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
import traceback
from datetime import timedelta
from itertools import islice
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while the slow imports below run: exit 130, no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(130))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
import torchvision.transforms as T
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

# the two --arch models whose auxiliary heads would return tuples in training mode
AUX_OFF = {a: {"aux_logits": False, "init_weights": True} for a in ("googlenet", "inception_v3")}


def ddp_setup(local_rank: int, args: argparse.Namespace) -> torch.device:
    """Join the process group torchrun set up, or the one the spawned ranks form."""
    if "RANK" not in os.environ:  # spawned by launch() below: one machine, rank = local rank
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                          WORLD_SIZE=str(args.nprocs))
    if torch.cuda.is_available() and not args.cpu:
        torch.cuda.set_device(local_rank)  # before any collective, or every rank uses cuda:0
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:  # fixed: NCCL needs a GPU per process; gloo runs anywhere
        device, backend = torch.device("cpu"), "gloo"
        if "OMP_NUM_THREADS" not in os.environ:  # the ranks share the cores (torchrun sets it)
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    level = dist.get_debug_level()
    if backend == "gloo" and level == dist.DebugLevel.DETAIL:  # torch bug (2.11-2.14): DDP
        dist.set_debug_level(dist.DebugLevel.INFO)  # segfaults on a gloo group DETAIL wrapped
    # A finite timeout: a dead or missing rank ends the job with an error instead of a hang.
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    dist.set_debug_level(level)  # DDP's own DETAIL checks stay on
    return device


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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


def image_folder(root: str, args: argparse.Namespace) -> Dataset:
    transforms = T.Compose([
        T.Resize(round(args.image_size * 256 / 224)),  # the tutorial's 256 -> 224, any size
        T.CenterCrop(args.image_size),
        T.ToTensor(),
        T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])
    # fixed: the tutorial's ImageFolder(root=, ...) is a syntax error
    return torchvision.datasets.ImageFolder(root, transform=transforms)


def load_data(args: argparse.Namespace, pin_memory: bool) -> DataLoader:
    if args.data:
        dataset = image_folder(args.data, args)
    else:
        dataset = SyntheticImages(args.synthetic_size, args.image_size, args.num_classes, args.seed)
    sampler = DistributedSampler(dataset, seed=args.seed)  # each rank its own share, shuffled
    # fixed: 4 * num_gpus workers in every process are 4 * num_gpus**2 in all; --workers is
    # per process. drop_last: a last batch of one image would break BatchNorm.
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=False, sampler=sampler,
                      num_workers=args.workers, pin_memory=pin_memory, drop_last=True)


def load_val_data(args: argparse.Namespace, pin_memory: bool) -> DataLoader:
    """This rank's share of --val-data: every world_size-th image, so each image is scored
    exactly once (a DistributedSampler would pad the shares with repeats)."""
    dataset = image_folder(args.val_data, args)
    share = Subset(dataset, range(dist.get_rank(), len(dataset), dist.get_world_size()))
    return DataLoader(share, batch_size=args.batch_size, num_workers=args.workers,
                      pin_memory=pin_memory)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    # fixed: pretrained=False is deprecated; weights=None is the same random init
    return torchvision.models.get_model(args.arch, weights=None, num_classes=args.num_classes,
                                        **AUX_OFF.get(args.arch, {}))


def save_model(epoch: int, model, optimizer, args: argparse.Namespace) -> Path:
    """Write epoch_N.pt and its sha256 (sha256sum's format) to temporary files, then rename
    both: a save that fails or is interrupted leaves the folder as it was."""
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"  # fixed: no file.touch(), torch.save makes it
    buffer = io.BytesIO()
    torch.save({"epoch": epoch, "model_state_dict": model.module.state_dict(),  # no "module."
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
    """Every rank loads the checkpoint rank 0 wrote at the end of `epoch`."""
    # The barrier guards the read: no rank may open epoch_N.pt before rank 0's os.replace has
    # published it. It stands before the load, not after the save, because the readers are the
    # ones who must wait: so it also covers --resume's first load, and nobody waits after the
    # last save. No barrier after the load: the next epoch's all-reduces keep the ranks in step.
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)  # NCCL: ours
    # fixed: map_location={'cuda:0': f'cuda:{rank}'} fails on a CPU, or if the saver was not on
    # cuda:0; this rank's own device always fits
    ckpt = read_checkpoint(Path(args.ckpt_dir) / f"epoch_{epoch}.pt", model.module, args, device)
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


def evaluate(model, val_loader: DataLoader, device: torch.device, args) -> list:
    """Top-1 on --val-data: each rank scores its share, one all_reduce sums [correct, seen]."""
    for buffer in model.module.buffers():  # BatchNorm's running statistics: rank 0's, as saved
        dist.broadcast(buffer, src=0)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
        for images, labels in val_loader:
            images = images.to(device, non_blocking=True, memory_format=fmt)
            labels = labels.to(device, non_blocking=True)
            predicted = model.module(images).argmax(dim=1)  # the bare model: no DDP collectives
            counts[0] += (predicted == labels).sum()
            counts[1] += len(labels)
    model.train()
    dist.all_reduce(counts)  # the whole validation set, not this rank's share alone
    return counts.tolist()


def run_training_process_on_given_gpu(local_rank: int, args: argparse.Namespace) -> None:
    device = ddp_setup(local_rank, args)
    try:
        hold_ckpt_dir(args)  # one run per checkpoint folder: a second one stops here
        fmt = torch.channels_last if args.channels_last else torch.contiguous_format
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = build_model(args).to(device, memory_format=fmt)
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
        criterion = torch.nn.CrossEntropyLoss()
        dataloader = load_data(args, pin_memory=device.type == "cuda")
        val_loader = load_val_data(args, device.type == "cuda") if args.val_data else None
        torch.backends.cudnn.benchmark = True  # one input size: find the fastest kernels once
        steps = min(len(dataloader), args.max_steps or len(dataloader))
        progress, final_loss, checkpoint, val = Progress(args, device, steps), None, None, None
        progress.first_line(where(device), len(dataloader.dataset))  # what runs where
        model.train()
        for epoch in range(args.start_epoch, args.epochs + 1):  # fixed: range(1, 30) ran 29
            if epoch > 1:
                load_model(device, epoch - 1, model, optimizer, args)
            dataloader.sampler.set_epoch(epoch)  # fixed: without it every epoch has one order
            epoch_loss = torch.zeros((), device=device)
            for step, (images, labels) in enumerate(islice(dataloader, steps), 1):
                images = images.to(device, non_blocking=True, memory_format=fmt)
                labels = labels.to(device, non_blocking=True)
                # bf16 autocast needs no GradScaler; it is meant for GPUs (a CPU runs it slowly)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                    loss = criterion(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                epoch_loss += loss.detach()
                progress.step(epoch, step, loss, len(images))
            dist.all_reduce(epoch_loss)  # fixed: every rank's steps, not rank 0's share alone
            final_loss = epoch_loss.item() / (steps * dist.get_world_size())
            if dist.get_rank() == 0:  # the global rank: LOCAL_RANK 0 is one writer per node
                checkpoint = save_model(epoch, model, optimizer, args)
            if val_loader:
                val = evaluate(model, val_loader, device, args)
            progress.summary(epoch, final_loss, val_text(val))
        if val_loader and args.start_epoch > args.epochs:  # a finished run resumed: score it
            load_model(device, args.resumed_from, model, optimizer, args)
            val = evaluate(model, val_loader, device, args)
            checkpoint = Path(args.ckpt_dir) / f"epoch_{args.resumed_from}.pt"
        report(args, device, progress, final_loss, checkpoint, val)
        del model  # before its process group goes: torch 2.11 (gloo) can hang at exit otherwise
    finally:
        cleanup()


# --- plumbing: launch, checks, arguments (the same in every DDP script) ---
LOST = 3  # the exit status of a rank that stopped only because another one failed


def launch(fn, args: argparse.Namespace) -> None:
    """Under torchrun run fn(LOCAL_RANK, args) here; else spawn it in --nprocs processes."""
    if "RANK" in os.environ:  # torchrun set RANK, WORLD_SIZE, LOCAL_RANK and MASTER_*
        # record: torchrun's failure summary shows this rank's exception
        return record(run_rank)(fn, int(os.environ["LOCAL_RANK"]), args)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port(os.environ.get("MASTER_PORT", "0")))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: Ctrl-C stays out of their imports
    ranks, stopped = mp.spawn(spawned, (fn, args, os.getpid()), args.nprocs, join=False), []

    def stop(signum, frame):  # Ctrl-C, kill: each rank ends its step or save cleanly, and exits
        stopped.append(signum)
        for p in ranks.processes:
            p.terminate()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:  # once a rank fails the others get 3 s before SIGTERM (mp.spawn's default: 30 s)
        while not ranks.join(grace_period=3):
            pass
    except mp.ProcessExitedException as e:
        if stopped:
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        codes, rank = [p.exitcode for p in ranks.processes], e.error_index
        if codes[rank] == LOST:  # it only lost a peer: the first that failed alone is the cause
            rank = next((r for r, code in enumerate(codes) if code not in (0, LOST)), rank)
        if codes[rank] > 0:  # the rank said why, above
            sys.exit(codes[rank])
        if codes[rank] == -signal.SIGABRT:  # NCCL's watchdog: not necessarily the culprit
            sys.exit(f"error: rank {rank} was aborted (SIGABRT), as NCCL aborts the ranks that "
                     f"wait in a collective past --timeout: another rank may have hung or died")
        sys.exit(f"error: rank {rank} was killed by {signal.Signals(-codes[rank]).name}; "
                 f"the others stopped")


def spawned(local_rank: int, fn, args: argparse.Namespace, launcher: int) -> None:
    # mp.spawn arms SIGINT as this rank's parent-death signal, only after the imports, and a
    # rank blocked in a collective would not see it: a dead launcher now kills it outright
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before that
        sys.exit(f"error: rank {local_rank}: its launcher is gone")
    try:
        run_rank(fn, local_rank, args)
    except Exception:  # print it here: mp.spawn would hand the launcher only the first one
        sys.exit(f"{traceback.format_exc()}error: rank {local_rank} failed (above)")


def run_rank(fn, local_rank: int, args: argparse.Namespace) -> None:
    """fn in this rank. Ctrl-C or SIGTERM end it cleanly (exit 130: a save in progress removes
    its temporary files); a peer that failed ends it quietly (LOST): that one says why."""
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        try:
            fn(local_rank, args)
        except RuntimeError as e:  # gloo's and NCCL's words for a peer that is gone
            if not any(w in str(e) for w in ("by peer", "Broken pipe", "remote process")):
                raise
            time.sleep(1)  # so the rank that failed ends first: launchers report the first one
            sys.exit(LOST)
    except KeyboardInterrupt:
        sys.exit(130)


def interrupt(signum, frame) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # a second one must not cut the clean-up short
        signal.signal(s, lambda *_: None)
    raise KeyboardInterrupt


def free_port(port: str) -> int:
    """Port 0: the OS picks a free one (a hard-coded 12355 collides); yours must be free."""
    try:
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], int(port)))
            return s.getsockname()[1]
    except (OSError, ValueError) as e:
        sys.exit(f"error: MASTER_PORT={port} cannot be used here ({getattr(e, 'strerror', e)}); "
                 f"unset it and a free port is picked")


def print0(*args) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # global rank 0 (unset before setup: the parent)
        print(*args, flush=True)


def where(device: torch.device) -> str:
    """What runs where, for the start line: "2 processes | gloo on CPU"."""
    n, kind = dist.get_world_size(), "CPU" if device.type == "cpu" else "GPUs"
    processes = f"{n} processes" if n > 1 else "1 process"
    return f"{processes} | {dist.get_backend()} on {kind}"


def duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if days else f"{hours}h{minutes:02d}m" if hours else \
        f"{minutes}m{seconds:02d}s"


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags every DDP script of the collection has."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nprocs", type=int, default=torch.cuda.device_count() or 2,
                   help="processes to spawn (ignored under torchrun); default: GPUs, or 2")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even where GPUs exist")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait")
    p.add_argument("--metrics-out", help="rank 0 writes the results here as JSON")
    return p


def check_args(args: argparse.Namespace, positive: tuple) -> None:
    """Refuse bad flag values and impossible launches before any process starts."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))  # srun -n N starts N copies
    if tasks > 1 and "RANK" not in os.environ:
        sys.exit(f"error: started as one of {tasks} SLURM tasks, each a job of its own; run one "
                 f"task per node, each running torchrun (README: On a SLURM cluster)")
    for name in ("nprocs", "timeout", *positive):
        value = getattr(args, name)  # None: not given, a default applies
        if value is not None and value <= 0:
            sys.exit(f"error: --{name.replace('_', '-')} must be positive, got {value}")
    gpus = 0 if args.cpu else torch.cuda.device_count()
    torchrun = "RANK" in os.environ  # as in launch(): then --nprocs is unused
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if torchrun else args.nprocs  # here
    if gpus and procs > gpus:
        flag = "torchrun --nproc-per-node" if torchrun else "--nprocs"
        sys.exit(f"error: {flag} {procs}, but {gpus} GPU(s); use at most that, or --cpu")
    try:  # the folder --metrics-out goes in, made now: no traceback after the training
        os.makedirs(os.path.dirname(os.path.abspath(args.metrics_out or "-")), exist_ok=True)
    except OSError as e:
        sys.exit(f"error: --metrics-out {args.metrics_out}: {e.strerror} ({e.filename})")


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


def val_text(val) -> str:
    return f" | val_accuracy {val[0] / val[1]:.4f} ({val[1]} images)" if val else ""


def report(args, device, progress: Progress, final_loss, checkpoint, val) -> None:
    """The final line and the metrics JSON, with images/s of every rank together."""
    rates = torch.tensor(progress.rate(), dtype=torch.float64, device=device)
    dist.all_reduce(rates)  # each rank timed its own share
    epochs, rate = len(range(args.start_epoch, args.epochs + 1)), rates.item()
    loss = "-" if final_loss is None else f"{final_loss:.4f}"  # None: nothing left to train
    print0(f"done | epochs {epochs} | final_loss {loss}{val_text(val)} | "
           f"{f'{rate:.0f}' if rate else '-'} img/s | checkpoint {checkpoint or '-'}")
    if dist.get_rank() == 0 and args.metrics_out:
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        Path(args.metrics_out).write_text(json.dumps({
            "script": "ddp_resnet.py", "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "device": device.type, "arch": args.arch,
            "epochs_run": epochs, "steps": progress.run, "final_loss": final_loss,
            "images_per_sec": rate or None, "checkpoint": checkpoint and str(checkpoint),
            "max_memory_gib": memory, "resumed_from": args.resumed_from,
            "val_accuracy": val and val[0] / val[1], "val_correct": val and val[0],
            "val_samples": val and val[1]}, indent=1))


def hold_ckpt_dir(args: argparse.Namespace) -> None:
    """Global rank 0 locks --ckpt-dir for as long as it runs (spawned: its launcher has done so
    already); if another run holds it, every rank stops and rank 0 says why."""
    error = [lock(args.ckpt_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        sys.exit(error[0] if dist.get_rank() == 0 else LOST)


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


def scan_image_folder(flag: str, root: str) -> tuple:
    """The class names and image count ImageFolder will find, or one error line."""
    try:  # without a traceback in every rank
        names, index = find_classes(root)
        return names, len(make_dataset(root, index, IMG_EXTENSIONS))
    except OSError as e:  # no folder, no class folders, a class folder without images
        hint = " (leave --data out for synthetic images)" if flag == "--data" else ""
        sys.exit(f"error: {flag} {root}: {e.strerror or e}; an ImageFolder root holds one folder "
                 f"of images per class{hint}")


def check_resnet(args: argparse.Namespace, world: int, workers: int) -> None:
    """Refuse a bad --arch, data or checkpoint before training; fill in what they decide."""
    if args.arch not in torchvision.models.list_models(module=torchvision.models):
        sys.exit(f"error: --arch {args.arch} is not a torchvision classification model; "
                 f"try resnet18 or resnet50")
    images, classes = args.synthetic_size, 1000
    if args.data:
        names, images = scan_image_folder("--data", args.data)
        classes = len(names)
        if (args.num_classes or classes) < classes:
            sys.exit(f"error: --num-classes {args.num_classes}, but --data has {classes} classes")
    if args.val_data and not args.data:
        sys.exit("error: --val-data needs --data, with the same class folders")
    if args.val_data and scan_image_folder("--val-data", args.val_data)[0] != names:
        sys.exit(f"error: --val-data {args.val_data} and --data {args.data} must hold the same "
                 f"class folders")
    args.num_classes = args.num_classes or classes
    if -(-images // world) < args.batch_size:  # each rank's share, padded by the sampler
        sys.exit(f"error: {images} images make no full batch of {args.batch_size} on each of "
                 f"{world} processes; lower --batch-size")
    args.workers = workers if args.workers is None else args.workers
    if args.workers < 0:
        sys.exit(f"error: --workers must be 0 or more, got {args.workers}")
    error = None if "RANK" in os.environ else lock(args.ckpt_dir)  # torchrun: rank 0 does it
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
    p = parser(__doc__)
    p.add_argument("--epochs", type=int, default=30, help="train epochs 1..N")
    p.add_argument("--batch-size", type=int, default=64, help="per process, as in the tutorial")
    p.add_argument("--lr", type=float, default=0.01, help="SGD, momentum 0.9, weight decay 1e-4")
    p.add_argument("--seed", type=int, default=0, help="model init, synthetic data, shuffling")
    p.add_argument("--max-steps", type=int, help="stop each epoch after N steps (smoke runs)")
    p.add_argument("--data", help="ImageFolder root; without it, synthetic in-memory images")
    p.add_argument("--val-data", help="ImageFolder root scored after every epoch (top-1)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--arch", default="resnet50", help="any torchvision classification model")
    p.add_argument("--num-classes", type=int, help="default: --data's classes, or 1000")
    p.add_argument("--synthetic-size", type=int, default=12800, help="synthetic images an epoch")
    p.add_argument("--workers", type=int,
                   help="loader processes per rank; default: 4 on GPU, with --data")
    p.add_argument("--amp", action="store_true", help="bf16 autocast (meant for GPUs)")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    p.add_argument("--ckpt-dir", default="model_checkpoints", help="rank 0 writes epoch_N.pt here")
    p.add_argument("--resume", action="store_true", help="go on after --ckpt-dir's newest epoch")
    p.add_argument("--log-every", type=int, default=10, help="a progress line every N steps")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps an epoch left out of img/s")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    check_args(args, positive=("epochs", "batch_size", "lr", "max_steps", "image_size",
                               "num_classes", "synthetic_size", "log_every", "warmup_steps"))
    gpus = 0 if args.cpu else torch.cuda.device_count()
    # 4 loader workers per GPU process decode images; in-memory synthetic ones need none
    check_resnet(args, int(os.environ.get("WORLD_SIZE", args.nprocs)),
                 workers=4 if gpus and args.data else 0)
    launch(run_training_process_on_given_gpu, args)
