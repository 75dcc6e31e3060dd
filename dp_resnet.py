"""DataParallel ResNet (AIME "Multi GPU training with PyTorch", part 1).

One process drives every visible GPU; each epoch saves a checkpoint that the next one
reloads. ddp_resnet.py is faster.

    python dp_resnet.py           # all visible GPUs, resnet50, synthetic images
    CUDA_VISIBLE_DEVICES=0,1 python dp_resnet.py --data /path/to/train --resume
    python dp_resnet.py --cpu --arch resnet18 --image-size 64 --epochs 2 --max-steps 10

It prints `start | ...`, `epoch 1/2 | step 10/10 | loss 7.0836 | 115 img/s`, a line
per epoch and `done | ...`.
"""

import argparse
import io
import json
import os
import signal
import sys
import time
from itertools import islice
from pathlib import Path

import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchvision import datasets, models


def load_datasets(args):
    """The training set and its number of classes."""
    size = args.image_size
    if not args.data:
        # 12,800 random images: 256 distinct ones, made once, with no decoding
        images = TensorDataset(torch.randn(256, 3, size, size), torch.arange(256))
        return Subset(images, [i % 256 for i in range(12800)]), 256
    # ImageNet's mean and standard deviation per colour
    normalize = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    # the tutorial's Resize(256) and CenterCrop(224), scaled to --image-size
    preprocess = T.Compose(
        [T.Resize(size * 8 // 7), T.CenterCrop(size), T.ToTensor(), normalize]
    )
    # fixed: the tutorial's ImageFolder(root=, ...) is a syntax error
    train = datasets.ImageFolder(args.data, transform=preprocess)
    return train, len(train.classes)


def build_model(args, num_classes):
    # fixed: pretrained=False is deprecated; weights=None is the same random init
    return models.get_model(args.arch, weights=None, num_classes=num_classes)


# a Sequential of the one model: its forward calls the model's
class Bf16Autocast(torch.nn.Sequential):
    """--amp: DataParallel runs each replica in a thread of its own and turns autocast
    on there with its default type, fp16. This one, inside the replica, says bf16."""

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return super().forward(x)


def newest_epoch(args):
    """N of the newest epoch_N.pt in --ckpt-dir, 0 if there is none."""
    numbers = [
        file.stem.removeprefix("epoch_")
        for file in Path(args.ckpt_dir).glob("epoch_*.pt")
    ]
    return max([int(n) for n in numbers if n.isdigit()], default=0)


def save_model(epoch, net, optimizer, args):
    """Atomic: written to a .tmp file, fsynced, then renamed over epoch_N.pt."""
    # fixed: no file.touch() first: torch.save makes the file
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"
    tmp = Path(f"{file}.tmp")
    # net is the bare model: its keys have no "module." prefix
    ckpt = dict(
        epoch=epoch,
        model_state_dict=net.state_dict(),
        optimizer_state_dict=optimizer.state_dict(),
    )
    # Serialized in memory (a second copy, for a moment), then written by us: a full
    # disk is then an OSError with its reason, not an error of torch's C++ writer.
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            # on disk before the rename publishes it
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except OSError as e:
        sys.exit(
            f"error: cannot save {file} ({e.strerror}); fix that, rerun with --resume"
        )
    finally:
        tmp.unlink(missing_ok=True)
    return str(file)


def load_model(epoch, net, optimizer, args):
    """One process: no barrier needed. --resume's file may be damaged or foreign."""
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"
    try:
        # Onto the CPU, whatever device saved it: load_state_dict copies the weights
        # into the model on GPU 0, and the optimizer moves its state to the model's
        # parameters.
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
        net.load_state_dict(ckpt["model_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    except Exception as e:
        # on one line, without torch's long advice on weights_only
        why = " ".join(str(e).split("WeightsUnpickler error:")[-1].split())
        sys.exit(f"error: cannot resume from {file}: {why[:300]}")


def train(model, dataloader, optimizer, device, epoch, steps, args):
    # shuffle=True draws each epoch's order from torch's generator. Seeded by the
    # epoch, a resumed run draws what an unbroken run drew: the order, the loader
    # workers' seeds, and the dropout of a model of your own.
    torch.manual_seed(epoch)
    # summed on the device: .item() at every step would wait for it
    loss_sum = torch.zeros((), device=device)
    began = time.monotonic()
    last_print = began
    for step, (images, labels) in enumerate(islice(dataloader, steps), start=1):
        images = images.to(device, non_blocking=True, memory_format=args.memory_format)
        optimizer.zero_grad(set_to_none=True)
        # --amp, bf16 (no GradScaler): Bf16Autocast does the replicas' forward; this
        # autocast does the loss, and the whole step on a CPU
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):
            loss = torch.nn.functional.cross_entropy(model(images), labels.to(device))
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach().float()
        # a line every 10 steps and at the last, and at least every 30 s
        if step % 10 == 0 or step == steps or time.monotonic() - last_print > 30:
            # .item() waits for the device, so the time after it is true
            value = loss.item()
            last_print = time.monotonic()
            rate = step * args.batch_size / (last_print - began)
            print(
                f"epoch {epoch}/{args.epochs} | step {step}/{steps}"
                f" | loss {value:.4f} | {rate:.0f} img/s"
            )
    # this epoch's mean loss; each epoch's replaces the one before, so the metrics
    # JSON's final_loss is the last epoch's
    return dict(
        final_loss=loss_sum.item() / steps,
        images_per_sec=steps * args.batch_size / (time.monotonic() - began),
    )


def run_training(gpus, train_set, num_classes, args):
    device = torch.device("cuda:0" if gpus else "cpu")
    # fixed: shuffle=False gave every epoch one order. drop_last: BatchNorm cannot
    # train on a 1-image batch.
    dataloader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=gpus > 0,
        drop_last=True,
    )
    # net: the bare model, which the checkpoints hold
    net = build_model(args, num_classes).to(device, memory_format=args.memory_format)
    model = Bf16Autocast(net) if args.amp else net
    if gpus:
        # every visible GPU (CUDA_VISIBLE_DEVICES chooses): at each step, DataParallel
        # copies the model from GPU 0 to them and splits the batch between them
        model = torch.nn.DataParallel(model)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4
    )
    steps = min(len(dataloader), args.max_steps or len(dataloader))
    # world_size: the GPUs DataParallel uses
    results = dict(script=Path(__file__).name, world_size=max(gpus, 1))
    results.update(device=device.type, model=type(net).__name__, steps=steps)
    first_epoch = (newest_epoch(args) + 1) if args.resume else 1
    start = " | ".join(f"{k} {v}" for k, v in results.items())
    print(f"start | {start} | {plan(first_epoch, args)}")
    # fixed: the tutorial's range(1, 30) ran 29 epochs
    for epoch in range(first_epoch, args.epochs + 1):
        if epoch > 1:
            load_model(epoch - 1, net, optimizer, args)
        results.update(train(model, dataloader, optimizer, device, epoch, steps, args))
        results["epochs_run"] = epoch + 1 - first_epoch
        results["checkpoint"] = save_model(epoch, net, optimizer, args)
        print(
            f"epoch {epoch}/{args.epochs} | loss {results['final_loss']:.4f}"
            f" | saved {results['checkpoint']}"
        )
    print(
        f"done | epochs_run {results.get('epochs_run', 0)}"
        f" | checkpoint {results.get('checkpoint', '-')}"
    )
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(results, indent=1))


def plan(first_epoch, args):
    """The start line's end: the epochs to run, and the checkpoint they go on from."""
    last = Path(args.ckpt_dir) / f"epoch_{first_epoch - 1}.pt"
    if first_epoch > args.epochs:
        return f"nothing to train: {last} reached --epochs {args.epochs}"
    epochs = f"epochs {first_epoch}-{args.epochs}"
    if first_epoch > 1:
        return f"resuming from {last} | {epochs}"
    return epochs


# --- launching and checks ---
# A copy may drop the refusals here and in __main__: bad input then ends in a
# traceback instead of one line. It must keep the SIGTERM line in __main__: a stop
# then ends a save as Ctrl-C does, and leaves no .tmp file.
def check_args(args):
    """Refuse bad input in one line each."""
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1:
        sys.exit(
            "error: srun -n N starts N separate trainings; DataParallel is one process"
        )
    if args.workers < 0:
        sys.exit(f"error: --workers {args.workers}: use 0 or more")
    newest = newest_epoch(args)
    # another run's checkpoints: a later --resume would go on from them
    if newest and not args.resume:
        file = Path(args.ckpt_dir) / f"epoch_{newest}.pt"
        sys.exit(
            f"error: {file} exists: add --resume to go on from it,"
            " or use another --ckpt-dir"
        )
    # before training, not after: a file in a folder's place, a read-only disk
    try:
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
        if args.metrics_out:
            Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
            # written at the end: can it be?
            open(args.metrics_out, "a").close()
    except OSError as e:
        sys.exit(f"error: cannot make {e.filename}: {e.strerror}")


def positive(text):
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(
            f"expected a whole number above 0, got {text!r}"
        )
    return int(text)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--cpu", action="store_true", help="the plain model on CPU even with GPUs"
    )
    p.add_argument("--metrics-out", help="write the results here as JSON")
    p.add_argument("--epochs", type=positive, default=30)
    p.add_argument(
        "--batch-size", type=positive, default=64, help="global, split over the GPUs"
    )
    p.add_argument(
        "--lr", type=float, default=0.01, help="SGD, momentum 0.9, weight decay 1e-4"
    )
    p.add_argument("--max-steps", type=positive, help="end each epoch after N steps")
    # read only by load_datasets and build_model: a copy that replaces them drops these
    p.add_argument("--data", help="an ImageFolder root; without it, synthetic images")
    p.add_argument("--image-size", type=positive, default=224)
    p.add_argument("--arch", default="resnet50", choices=models.list_models(models))
    p.add_argument(
        "--workers", type=int, default=4 * torch.cuda.device_count(), help="loaders"
    )
    p.add_argument("--amp", action="store_true", help="bf16 autocast, for GPUs")
    p.add_argument(
        "--channels-last", action="store_true", help="NHWC memory format, for GPUs"
    )
    p.add_argument(
        "--ckpt-dir", default="model_checkpoints", help="where epoch_N.pt goes"
    )
    p.add_argument(
        "--resume", action="store_true", help="go on after the newest epoch_N.pt"
    )
    args = p.parse_args()
    args.memory_format = torch.contiguous_format
    if args.channels_last:
        args.memory_format = torch.channels_last
    return args


if __name__ == "__main__":
    args = parse_args()
    check_args(args)
    # CUDA_VISIBLE_DEVICES chooses them
    gpus = 0 if args.cpu else torch.cuda.device_count()
    # the same synthetic images and initial weights in every run
    torch.manual_seed(0)
    # ImageFolder raises for a missing folder, no class folders, a class without images
    try:
        train_set, num_classes = load_datasets(args)
    except OSError as e:
        sys.exit(f"error: --data {args.data}: {e}")
    # drop_last would leave no step at all
    if len(train_set) < args.batch_size:
        sys.exit(
            f"error: {len(train_set)} images,"
            f" too few for --batch-size {args.batch_size}"
        )
    # DataParallel splits each batch as Tensor.chunk does: the last piece is the
    # smallest. BatchNorm cannot train on one value per channel, which a ResNet's last
    # block has with 1 image at 32 px (at 224 px, 1 image trains): ask the model.
    pieces = torch.empty(args.batch_size).chunk(max(gpus, 1))
    if len(pieces[-1]) == 1:
        try:
            # the first training image, as a batch of 1
            build_model(args, num_classes)(train_set[0][0].unsqueeze(0))
        except ValueError as e:
            sys.exit(
                f"error: --batch-size {args.batch_size} leaves a device 1 image, too"
                f" few at --image-size {args.image_size} ({e}); use a larger"
                " --batch-size or --image-size"
            )
    # SIGTERM (a stop) ends a save as Ctrl-C does: its .tmp file is removed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run_training(gpus, train_set, num_classes, args)
    except KeyboardInterrupt:
        # Ctrl-C: a save in progress has removed its temporary file
        sys.exit(130)
