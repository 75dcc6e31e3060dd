#!/usr/bin/env python3
"""DataParallel ResNet training: one process drives every visible GPU, plain model on CPU.

Follows AIME "Multi GPU training with PyTorch", part 1 (DataParallel): global batch 64 split
over the GPUs, a checkpoint each epoch, reloaded at the start of the next. Without --data it
trains on synthetic in-memory images. For real multi-GPU speed use ddp_resnet.py.

    python dp_resnet.py                                  # all visible GPUs, resnet50, global batch 64
    python dp_resnet.py --gpus 2 --data /path/to/imagenet/train
    python dp_resnet.py --resume                         # continue after the newest model_checkpoints/epoch_N.pt
    python dp_resnet.py --cpu --arch resnet18 --image-size 64 --epochs 2 --max-steps 5
    python dp_resnet.py --no-wrap --batch-size 256 --epochs 1   # the baseline: bare model on cuda:0

It prints `epoch 1/2 | step 5/5 | loss 6.9312 | 120 img/s` lines and a final line:
    done | epochs 2 | final_loss 6.9123 | 118 img/s | checkpoint model_checkpoints/epoch_2.pt
"""
import argparse
import hashlib
import io
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import is_image_file

POOL = 256  # distinct synthetic images kept in memory; larger --synthetic-size repeats them


# --- helpers repeated on purpose (print0 and write_json of the DDP scripts): keep them identical ---
def print0(*args) -> None:
    """Print from global rank 0 only (RANK is unset before the group exists)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


def write_json(path: str, obj: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
# --- end of the repeated helpers ---


class SyntheticImages(Dataset):
    """Images made once from the seed and held as tensors: no decoding or PIL work per sample,
    so images/s measures the model and not the CPU."""

    def __init__(self, size: int, image_size: int, num_classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(min(size, POOL), 3, image_size, image_size, generator=g)
        self.labels = torch.randint(num_classes, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i % len(self.images)], self.labels[i]


def load_data(args: argparse.Namespace, pin_memory: bool, generator: torch.Generator) -> DataLoader:
    if args.data:
        transforms = T.Compose([
            T.Resize(round(args.image_size * 256 / 224)),  # the tutorial's 256 -> 224, at any size
            T.CenterCrop(args.image_size),
            T.ToTensor(),
            T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ])
        dataset = torchvision.datasets.ImageFolder(args.data, transform=transforms)  # fixed: `root=,` was a syntax error
    else:
        dataset = SyntheticImages(args.synthetic_size, args.image_size, args.num_classes, args.seed)
    # fixed: shuffle=False showed every epoch the same order; the generator is reseeded per epoch
    # (as DistributedSampler.set_epoch does), so --resume sees the order an uninterrupted run sees.
    # fixed: 4*num_gpus workers is 0 on a CPU machine; --workers defaults to 4 per GPU, 0 on CPU.
    # drop_last: a last batch of one image would break BatchNorm in training
    dataloader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, generator=generator,
                            num_workers=args.workers, pin_memory=pin_memory, drop_last=True)
    if len(dataloader) == 0:
        sys.exit(f"error: {len(dataset)} images make no full batch of {args.batch_size}; lower --batch-size")
    return dataloader


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    # their auxiliary heads return tuples in training mode
    extra = {"aux_logits": False, "init_weights": True} if args.arch in ("googlenet", "inception_v3") else {}
    # fixed: pretrained=False is deprecated; weights=None is the same random init
    return torchvision.models.get_model(args.arch, weights=None, num_classes=args.num_classes, **extra)


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
    """Write epoch_N.pt and, first, its sha256 (sha256sum's format) next to it, both atomically:
    a crash mid-save leaves no half-written file, and bytes altered later are caught on load."""
    folder = Path(args.ckpt_dir)
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"epoch_{epoch}.pt"  # fixed: no file.touch(), torch.save creates the file
    buffer = io.BytesIO()
    torch.save({"epoch": epoch, "model_state_dict": unwrap(model).state_dict(),  # no "module." prefix
                "optimizer_state_dict": optimizer.state_dict(), "arch": args.arch,
                "num_classes": args.num_classes, "image_size": args.image_size}, buffer)
    data = buffer.getvalue()
    write_atomic(file.with_name(file.name + ".sha256"), f"{hashlib.sha256(data).hexdigest()}  {file.name}\n".encode())
    write_atomic(file, data)
    return file


def write_atomic(file: Path, data: bytes) -> None:
    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the data is on disk before the rename publishes it
    os.replace(tmp, file)


def read_checkpoint(file: Path, model, optimizer, args: argparse.Namespace, map_location, assign=False) -> None:
    """Load file into model and optimizer; anything wrong with it is one error line naming the file."""
    fix = "delete it (and its .sha256) to resume from the one before, or use another --ckpt-dir"
    try:
        data = file.read_bytes()
    except OSError as e:
        sys.exit(f"error: cannot read checkpoint {file} ({e.strerror}); {fix}")
    digest = file.with_name(file.name + ".sha256")
    if digest.is_file():
        if digest.read_text().split()[:1] != [hashlib.sha256(data).hexdigest()]:
            sys.exit(f"error: checkpoint {file} does not match {digest.name}: altered or damaged after it was written; {fix}")
    try:
        ckpt = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)  # data only, never code
    except Exception as e:  # truncated, corrupt, not a torch file, or objects weights_only refuses
        reason = " ".join(str(e).split("WeightsUnpickler error:")[-1].split())[:120] or "empty file"
        sys.exit(f"error: cannot read checkpoint {file} ({type(e).__name__}: {reason}); {fix}")
    if not isinstance(ckpt, dict) or not {"epoch", "model_state_dict", "optimizer_state_dict"} <= ckpt.keys():
        sys.exit(f"error: {file} is not a checkpoint of this script (needs epoch, model_state_dict, "
                 f"optimizer_state_dict); move it away or use another --ckpt-dir")
    try:
        model.load_state_dict(ckpt["model_state_dict"], assign=assign)
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    except Exception:  # missing or extra keys, other shapes, other optimizer groups
        sys.exit(f"error: {file} holds a {ckpt.get('arch', '?')} with {ckpt.get('num_classes', '?')} classes, "
                 f"not --arch {args.arch} --num-classes {args.num_classes}; pass those or use another --ckpt-dir")
    if not digest.is_file() and int(os.environ.get("RANK", "0")) == 0:  # e.g. copied without it
        print(f"warning: {file} has no {digest.name} next to it; loaded unverified", file=sys.stderr, flush=True)


def load_model(device: torch.device, epoch: int, model, optimizer, args: argparse.Namespace) -> None:
    # One process, so no barrier: the save before this line has returned. The weights go to the
    # device the wrapped model lives on (DataParallel broadcasts them from there every step).
    read_checkpoint(Path(args.ckpt_dir) / f"epoch_{epoch}.pt", unwrap(model), optimizer, args, map_location=device)


def newest_checkpoint(folder: str):
    found = [(int(m[1]), p) for p in Path(folder).glob("epoch_*.pt") if (m := re.fullmatch(r"epoch_(\d+)\.pt", p.name))]
    return max(found, default=(0, None))


def sync(gpus: int) -> None:
    for i in range(gpus):
        torch.cuda.synchronize(i)  # the GPUs run ahead of Python: wait before reading the clock


def run_training(gpus: int, args: argparse.Namespace) -> None:
    wrap = gpus > 0 and not args.no_wrap
    if wrap:
        device = torch.device("cuda", 0)  # DataParallel scatters from and gathers to the first GPU
        print0(f"DataParallel over {gpus} GPU(s), global batch {args.batch_size}")
    elif gpus:
        device = torch.device("cuda", 0)
        print0(f"--no-wrap: training the plain model on cuda:0 without DataParallel, batch {args.batch_size}")
    else:
        device = torch.device("cpu")
        print0(f"{'--cpu' if args.cpu else 'no GPUs visible'}: training the plain model on CPU (DataParallel needs GPUs)")
    torch.backends.cudnn.benchmark = True  # fixed input size: pick the fastest kernels once
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(args.seed)
    model = build_model(args).to(device, memory_format=fmt)
    if wrap:
        if args.amp:  # without DataParallel the autocast around the loss covers the forward too
            model = Bf16Autocast(model)
        model = torch.nn.parallel.DataParallel(model, device_ids=list(range(gpus)), dim=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    criterion = torch.nn.CrossEntropyLoss()
    generator = torch.Generator()
    dataloader = load_data(args, pin_memory=bool(gpus), generator=generator)
    total_steps = min(len(dataloader), args.max_steps or len(dataloader))
    model.train()
    steps, final_loss, checkpoint, rates = 0, None, None, []
    for epoch in range(args.start_epoch, args.epochs + 1):  # fixed: range(1, num_epochs) ran one epoch short
        if epoch > 1:
            load_model(device, epoch - 1, model, optimizer, args)
        generator.manual_seed(args.seed + epoch)
        loss_sum, n, t0, seen = torch.zeros((), device=device), 0, None, 0
        if args.warmup_steps == 0:
            sync(gpus)
            t0 = time.perf_counter()
        for step, (images, labels) in enumerate(dataloader, 1):
            images = images.to(device, non_blocking=True, memory_format=fmt)
            labels = labels.to(device, non_blocking=True)
            # bf16 autocast is meant for GPUs (no GradScaler needed for bf16); on CPU it works, slowly.
            # Here it covers the loss; Bf16Autocast covers the replicas.
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            n, seen = n + 1, seen + images.size(0)
            # Time windows of --log-every steps after --warmup-steps in each epoch: the first epoch
            # warms cuDNN and the allocator, later ones restart the loader after the reload.
            if step >= args.warmup_steps and (step - args.warmup_steps) % args.log_every == 0:
                sync(gpus)
                now = time.perf_counter()
                if t0 is not None:
                    # the global batch over all GPUs: no division by the GPU count (AIME's benchmark does)
                    rates.append(seen / (now - t0))
                t0, seen = now, 0
            if step % args.log_every == 0 or step == total_steps:
                rate = f"{rates[-1]:.0f}" if rates else "-"
                print0(f"epoch {epoch}/{args.epochs} | step {step}/{total_steps} | loss {loss.item():.4f} | {rate} img/s")
            if step == total_steps:
                break
        steps += n
        final_loss = (loss_sum / n).item()
        checkpoint = save_model(epoch, model, optimizer, args)
    epochs_run = len(range(args.start_epoch, args.epochs + 1))
    images_per_sec = statistics.median(rates) if rates else None
    ips = f"{images_per_sec:.0f}" if images_per_sec else "-"
    loss_text = f"{final_loss:.4f}" if final_loss is not None else "-"
    print0(f"done | epochs {epochs_run} | final_loss {loss_text} | {ips} img/s | checkpoint {checkpoint or '-'}")
    if args.metrics_out:
        write_json(args.metrics_out, {
            "script": "dp_resnet.py", "world_size": gpus or 1, "backend": "none", "device": device.type,
            "wrapper": "DataParallel" if wrap else None,
            "arch": args.arch, "epochs_run": epochs_run, "steps": steps, "final_loss": final_loss,
            "images_per_sec": images_per_sec, "window_images_per_sec": rates,
            "max_memory_gib": [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(gpus)] if gpus else None,
            "checkpoint": str(checkpoint) if checkpoint else None, "resumed_from": args.resumed_from,
        })


def check_args(args: argparse.Namespace) -> int:
    """Refuse bad flags, data and checkpoints before training; fill in the defaults. Returns the GPU count."""
    for flag in ("epochs", "batch_size", "lr", "image_size", "synthetic_size", "log_every", "max_steps", "num_classes", "gpus"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            sys.exit(f"error: --{flag.replace('_', '-')} must be positive, got {value}")
    for flag in ("momentum", "weight_decay", "warmup_steps", "workers"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            sys.exit(f"error: --{flag.replace('_', '-')} must not be negative, got {value}")
    visible = 0 if args.cpu else torch.cuda.device_count()
    if args.gpus is not None and args.gpus > visible:
        sys.exit(f"error: --gpus {args.gpus} but {visible} GPU(s) visible{' with --cpu' if args.cpu else ''}; "
                 f"leave --gpus out to use all of them (the CPU when there are none)")
    if args.no_wrap and (args.gpus or 1) != 1:
        sys.exit(f"error: --no-wrap trains on one device, not --gpus {args.gpus}; leave --gpus out")
    gpus = min(1, visible) if args.no_wrap else args.gpus or visible
    if args.arch not in torchvision.models.list_models(module=torchvision.models):
        sys.exit(f"error: --arch {args.arch} is not a torchvision classification model; try resnet18 or resnet50")
    classes = 1000
    if args.data:
        if not os.path.isdir(args.data):
            sys.exit(f"error: --data {args.data} is not a folder; pass an ImageFolder root (one sub-folder per class) "
                     f"or leave --data out for synthetic images")
        folders = sorted(e.path for e in os.scandir(args.data) if e.is_dir())
        if not folders:  # ImageFolder would fail later with a traceback
            sys.exit(f"error: --data {args.data} has no class folders; an ImageFolder root holds one sub-folder of images per class")
        for c in folders:
            if not any(is_image_file(f) for _, _, fs in os.walk(c, followlinks=True) for f in fs):
                sys.exit(f"error: --data: class folder {c} holds no images (.jpg, .png, ...); add some or remove the folder")
        classes = len(folders)
        if args.num_classes is not None and args.num_classes < classes:
            sys.exit(f"error: --num-classes {args.num_classes} but --data has {classes} class folders; leave it out")
    elif args.synthetic_size < args.batch_size:
        sys.exit(f"error: --synthetic-size {args.synthetic_size} makes no full batch of {args.batch_size}; "
                 f"raise it or lower --batch-size")
    args.num_classes = args.num_classes or classes
    if args.workers is None:
        args.workers = 4 * gpus  # the tutorial's 4 per GPU, 0 on CPU
    args.start_epoch, args.resumed_from = 1, None
    if args.resume:
        epoch, file = newest_checkpoint(args.ckpt_dir)
        if file is None:
            print0(f"--resume: no checkpoint in {args.ckpt_dir}, starting fresh")
            return gpus
        with torch.device("meta"):  # check that it fits the model without building the weights twice
            model = build_model(args)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        read_checkpoint(file, model, optimizer, args, map_location="cpu", assign=True)
        args.start_epoch, args.resumed_from = epoch + 1, epoch
        print0(f"--resume: continuing after {file}, epochs {epoch + 1}..{args.epochs}" if epoch < args.epochs
               else f"--resume: {file} already reached --epochs {args.epochs}, nothing to train")
    return gpus


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpus", type=int, help="GPUs to use (the first N); default: all visible")
    p.add_argument("--cpu", action="store_true", help="train the plain model on CPU even where GPUs exist")
    p.add_argument("--no-wrap", action="store_true",
                   help="no DataParallel: the plain model on one device (cuda:0, or the CPU), the benchmarks' baseline")
    p.add_argument("--epochs", type=int, default=30, help="train epochs 1..N")
    p.add_argument("--batch-size", type=int, default=64, help="global, split over the GPUs, as in the tutorial")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0, help="model init, synthetic data and shuffling")
    p.add_argument("--max-steps", type=int, help="stop each epoch after N steps (smoke runs)")
    p.add_argument("--data", help="ImageFolder root; without it, synthetic in-memory images")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--arch", default="resnet50", help="any torchvision classification model")
    p.add_argument("--num-classes", type=int, help="default: the ImageFolder's class count, or 1000")
    p.add_argument("--synthetic-size", type=int, default=12800, help=f"synthetic images per epoch ({POOL} distinct)")
    p.add_argument("--workers", type=int, help="DataLoader workers; default: 4 per GPU, 0 on CPU")
    p.add_argument("--amp", action="store_true", help="bf16 autocast (meant for GPUs)")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    p.add_argument("--ckpt-dir", default="model_checkpoints", help="where epoch_N.pt is written")
    p.add_argument("--resume", action="store_true", help="continue after the newest checkpoint in --ckpt-dir")
    p.add_argument("--log-every", type=int, default=10, help="progress line and throughput window every N steps")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps per epoch left out of images/s")
    p.add_argument("--metrics-out", help="write the results here as JSON")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    run_training(check_args(args), args)
