"""DataParallel ResNet (AIME "Multi GPU training with PyTorch", part 1): one process, every
visible GPU, a checkpoint each epoch reloaded at the start of the next. ddp_resnet.py is faster.
    python dp_resnet.py                         # all visible GPUs, resnet50, synthetic images
    CUDA_VISIBLE_DEVICES=0,1 python dp_resnet.py --data /path/to/train --resume
    python dp_resnet.py --cpu --arch resnet18 --image-size 64 --epochs 2 --max-steps 10
It prints `start | ...`, `epoch 1/2 | step 10/10 | loss 7.0836 | 115 img/s`, epoch, done lines."""

import argparse
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchvision import datasets, models


def load_datasets(args: argparse.Namespace) -> tuple:
    if not args.data:  # 12,800 random images, 256 distinct ones made once: no decoding
        g, size = torch.Generator().manual_seed(0), args.image_size
        images = TensorDataset(torch.randn(256, 3, size, size, generator=g), torch.arange(256))
        return Subset(images, [i % 256 for i in range(12800)]), 256
    size, imagenet = args.image_size, ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    # the tutorial's Resize(256), CenterCrop(224) at any --image-size; ImageNet's mean and std
    resize = [T.Resize(size * 8 // 7), T.CenterCrop(size), T.ToTensor(), T.Normalize(*imagenet)]
    # fixed: the tutorial's ImageFolder(root=, ...) is a syntax error
    train = datasets.ImageFolder(args.data, transform=T.Compose(resize))
    return train, len(train.classes)


def build_model(args: argparse.Namespace, num_classes: int) -> torch.nn.Module:
    # fixed: pretrained=False is deprecated; weights=None is the same random init
    return models.get_model(args.arch, weights=None, num_classes=num_classes)


class Bf16Autocast(torch.nn.Sequential):  # --amp: DataParallel's threads would autocast to fp16
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return super().forward(x)


def save_model(epoch: int, net: torch.nn.Module, optimizer, args) -> str:  # tmp, fsync, rename
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"  # fixed: no file.touch(): torch.save makes it
    ckpt = dict(epoch=epoch, model_state_dict=net.state_dict())  # the bare model: no "module."
    tmp, buffer = file.with_name(file.name + ".tmp"), io.BytesIO()
    torch.save({**ckpt, "optimizer_state_dict": optimizer.state_dict()}, buffer)  # in memory
    try:  # written by us: a full disk is an OSError that says so
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            os.fsync(f.fileno())  # on disk before the rename publishes it
        os.replace(tmp, file)
    except OSError as e:  # a full disk, a read-only folder
        sys.exit(f"error: cannot save {file} ({e.strerror}); fix that, rerun with --resume")
    finally:
        tmp.unlink(missing_ok=True)
    return str(file)


def load_model(epoch: int, net: torch.nn.Module, optimizer, args) -> None:
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"  # one process: no barrier needed
    try:  # onto GPU 0, where DataParallel copies from; --resume's may be damaged or foreign
        ckpt = torch.load(file, map_location=next(net.parameters()).device, weights_only=True)
        net.load_state_dict(ckpt["model_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    except Exception as e:
        why = " ".join(str(e).split("WeightsUnpickler error:")[-1].split())  # on one line
        sys.exit(f"error: cannot resume from {file}: {why[:300]}")


def run_training(gpus: int, train_set, num_classes: int, args: argparse.Namespace) -> None:
    # fixed: shuffle=False gave every epoch one order; seeded per epoch (below), a resumed run has
    # an unbroken one's orders, augmentation and dropout. drop_last: BatchNorm fails on 1 image.
    kwargs = dict(num_workers=args.workers, pin_memory=gpus > 0, drop_last=True)
    device = torch.device("cuda" if gpus else "cpu", 0)
    dataloader = DataLoader(train_set, args.batch_size, True, **kwargs)
    torch.manual_seed(0)
    model = net = build_model(args, num_classes).to(device, memory_format=args.memory_format)
    if gpus:  # the replicas start on GPU 0; see Bf16Autocast
        model = torch.nn.DataParallel(Bf16Autocast(net) if args.amp else net, list(range(gpus)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    steps = min(len(dataloader), args.max_steps or len(dataloader))
    m = dict(script=Path(__file__).name, world_size=max(gpus, 1), device=device.type)
    m.update(model=type(net).__name__, steps=steps)  # world_size: the GPUs DataParallel uses
    print("start |", " | ".join(f"{k} {v}" for k, v in m.items()), "|", args.todo)
    for epoch in range(args.start_epoch, args.epochs + 1):  # fixed: range(1, 30) ran 29 epochs
        if epoch > 1:
            load_model(epoch - 1, net, optimizer, args)
        torch.manual_seed(epoch)  # the order and the randomness of each epoch, see above
        total, began, shown = torch.zeros((), device=device), time.monotonic(), time.monotonic()
        for step, (images, labels) in zip(range(1, steps + 1), dataloader, strict=False):
            images = images.to(device, non_blocking=True, memory_format=args.memory_format)
            with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):  # no GradScaler
                loss = torch.nn.functional.cross_entropy(model(images), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach().float()
            if step % 10 == 0 or step == steps or time.monotonic() - shown > 30:  # never quiet
                head = f"epoch {epoch}/{args.epochs} | step {step}/{steps} | loss {loss.item():.4f}"
                shown = time.monotonic()  # after .item(), which waits for the device
                print(f"{head} | {step * args.batch_size / (time.monotonic() - began):.0f} img/s")
        m.update(final_loss=total.item() / steps, epochs_run=epoch + 1 - args.start_epoch)
        m.update(images_per_sec=steps * args.batch_size / (time.monotonic() - began))
        m["checkpoint"] = save_model(epoch, net, optimizer, args)
        print(f"epoch {epoch}/{args.epochs} | loss {m['final_loss']:.4f} | saved {m['checkpoint']}")
    print(f"done | epochs_run {m.get('epochs_run', 0)} | checkpoint {m.get('checkpoint', '-')}")
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(m, indent=1))


# --- launching and checks ---
def check_args(args: argparse.Namespace) -> int:  # refuse in one line; the GPUs to use
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1:  # srun -n 2 python dp_resnet.py
        sys.exit("error: srun -n N starts N separate trainings; DataParallel is one process")
    gpus = 0 if args.cpu else torch.cuda.device_count()  # CUDA_VISIBLE_DEVICES chooses them
    if args.batch_size < 2 * gpus:  # DataParallel splits it, and BatchNorm needs 2 images
        sys.exit(f"error: --batch-size {args.batch_size} for {gpus} GPUs: use 2 or more a GPU")
    saved = [f for f in Path(args.ckpt_dir).glob("epoch_*.pt") if f.stem[6:].isdigit()]
    file = max(saved, key=lambda f: int(f.stem[6:]), default=None)  # the newest
    if file and not args.resume:  # another run's: a later --resume would go on from it
        sys.exit(f"error: {file} exists: add --resume to go on from it, or use another --ckpt-dir")
    try:  # before training, not after: a file in a folder's place, a read-only disk
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
        Path(args.metrics_out or ".").parent.mkdir(parents=True, exist_ok=True)
        open(args.metrics_out or os.devnull, "a").close()  # written at the end: can it be?
    except OSError as e:
        sys.exit(f"error: cannot make {e.filename}: {e.strerror}")
    args.start_epoch = int(file.stem[6:]) + 1 if file else 1
    args.todo = f"resuming from {file} | " * bool(file) + f"epochs {args.start_epoch}-{args.epochs}"
    if args.start_epoch > args.epochs:  # a finished run resumed
        args.todo = f"nothing to train: {file} reached --epochs {args.epochs}"
    args.memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    return gpus


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the plain model on CPU even with GPUs")
    p.add_argument("--metrics-out", help="write the results here as JSON")
    p.add_argument("--epochs", type=positive, default=30)
    p.add_argument("--batch-size", type=positive, default=64, help="global, split over the GPUs")
    p.add_argument("--lr", type=float, default=0.01, help="SGD, momentum 0.9, weight decay 1e-4")
    p.add_argument("--max-steps", type=positive, help="end each epoch after N steps")
    p.add_argument("--data", help="an ImageFolder root; without it, synthetic images")
    p.add_argument("--image-size", type=positive, default=224)
    p.add_argument("--arch", default="resnet50", choices=models.list_models(models))
    p.add_argument("--workers", type=int, default=4 * torch.cuda.device_count(), help="loaders")
    p.add_argument("--amp", action="store_true", help="bf16 autocast, for GPUs")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format, for GPUs")
    p.add_argument("--ckpt-dir", default="model_checkpoints", help="where epoch_N.pt goes")
    p.add_argument("--resume", action="store_true", help="go on after the newest epoch_N.pt")
    return p.parse_args()


def positive(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return int(text)


if __name__ == "__main__":
    args = parse_args()
    gpus = check_args(args)
    try:  # ImageFolder: no folder, no class folders, a class without images
        train_set, num_classes = load_datasets(args)
    except OSError as e:
        sys.exit(f"error: --data {args.data}: {e}")
    if len(train_set) < args.batch_size:  # drop_last would leave no step at all
        sys.exit(f"error: {len(train_set)} images, too few for --batch-size {args.batch_size}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop ends a save as Ctrl-C does
    try:
        run_training(gpus, train_set, num_classes, args)
    except KeyboardInterrupt:  # Ctrl-C: a save in progress has removed its temporary file
        sys.exit(130)
