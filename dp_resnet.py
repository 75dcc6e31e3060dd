"""DataParallel ResNet (AIME "Multi GPU training with PyTorch", part 1).

One process drives every visible GPU; each epoch saves a checkpoint that the next
one reloads. ddp_resnet.py is faster.

    python dp_resnet.py           # all visible GPUs, resnet50, random images
    CUDA_VISIBLE_DEVICES=0,1 python dp_resnet.py --data /path/to/train --resume
    python dp_resnet.py --cpu --arch resnet18 --image-size 32 --epochs 2 --max-steps 3

It prints `start | ...`, `epoch 1/2 | step 3/3 | loss 7.0836 | 115 img/s`, a line
per epoch and `done | ...`.
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from multiprocessing import forkserver, util
from pathlib import Path

# Ctrl-C while torch imports (seconds): exit at once, without a traceback;
# __main__ sets the handler for the rest of the run
signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch
import torch.multiprocessing as mp
import torchvision.transforms as T
from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset
from torchvision import datasets, models


def load_datasets(args):
    """The training set and its number of classes."""
    size = args.image_size
    if not args.data:
        # no --data: 256 random images labelled 0..255, repeated 50 times, so
        # that the model can memorise them (the loss falls)
        images = TensorDataset(torch.randn(256, 3, size, size), torch.arange(256))
        return ConcatDataset([images] * 50), 256
    # the tutorial's Resize(256), CenterCrop(224), scaled to --image-size
    preprocess = T.Compose(
        [
            T.Resize(size * 256 // 224),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    # fixed: the tutorial's `ImageFolder(root=, ...)` is a SyntaxError
    train = datasets.ImageFolder(args.data, transform=preprocess)
    return train, len(train.classes)


def build_model(args, num_classes):
    # fixed: pretrained=False is deprecated; weights=None is the same
    return models.get_model(args.arch, weights=None, num_classes=num_classes)


def prepare_dataloader(dataset, gpus, args):
    # a DataLoader whose workers a stop or a crash cannot leave behind (WorkerLoader)
    return WorkerLoader(
        dataset,
        # the global batch: DataParallel splits it between the GPUs
        args.batch_size,
        # fixed: the tutorial's shuffle=False gave every epoch one order
        shuffle=True,
        num_workers=args.workers,
        pin_memory=gpus > 0,
        # BatchNorm cannot train on a last batch of 1 image
        drop_last=True,
    )


class Bf16Autocast(torch.nn.Sequential):
    """--amp with DataParallel: it runs each GPU's copy of the model in a thread
    whose autocast is fp16, whatever train()'s dtype; each copy of this wrapper
    turns its own autocast to bf16."""

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return super().forward(x)


def train(model, dataloader, optimizer, device, epoch, args):
    """One epoch: its mean loss, and images/s."""
    # a seed for each epoch: after --resume, the shuffle and the random draws of your
    # model and data (dropout, random crops) repeat an unbroken run's, bit for bit
    torch.manual_seed(epoch)
    steps = len(dataloader)
    # the epoch's summed loss, kept on the device: no .item() wait at each step
    loss_sum = torch.zeros((), device=device)
    began = last_print = time.monotonic()
    for step, (images, labels) in enumerate(dataloader, start=1):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad()
        # --amp: bf16 autocast (in DataParallel's threads, Bf16Autocast's)
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):
            outputs = model(images)
            loss = torch.nn.functional.cross_entropy(outputs, labels)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        # a line every 10 steps, at the last, and at least every 30 s
        if step % 10 == 0 or step == steps or time.monotonic() - last_print > 30:
            batch_loss = loss.item()
            now = time.monotonic()
            rate = step * args.batch_size / (now - began)
            print(
                f"epoch {epoch}/{args.epochs} | step {step}/{steps}"
                f" | loss {batch_loss:.4f} | {rate:.0f} img/s"
            )
            last_print = now
    rate = steps * args.batch_size / (time.monotonic() - began)
    return loss_sum.item() / steps, rate


def newest_epoch(args):
    """N of the newest epoch_N.pt in --ckpt-dir; 0 if there is none."""
    # epoch_1.pt, epoch_2.pt, ...: no other name is one of ours
    files = Path(args.ckpt_dir).glob("epoch_[1-9]*.pt")
    names = [file.stem.removeprefix("epoch_") for file in files]
    return max([int(n) for n in names if n.isdecimal()], default=0)


def save_model(epoch, bare_model, optimizer, args):
    """Atomic: written to a .tmp file, fsynced, then renamed to epoch_N.pt."""
    file = f"{args.ckpt_dir}/epoch_{epoch}.pt"
    # fixed: the tutorial's file.touch() left an empty checkpoint if the save failed
    tmp = Path(f"{file}.tmp")
    ckpt = dict(
        epoch=epoch,
        # the bare model: its keys have no "module." prefix
        model_state_dict=bare_model.state_dict(),
        optimizer_state_dict=optimizer.state_dict(),
    )
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            # on the disk before the rename makes it epoch_N.pt
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except RuntimeError as e:
        # torch.save turns a Ctrl-C's SystemExit into a RuntimeError: unwrap it
        if isinstance(e.__context__, SystemExit):
            raise e.__context__ from None
        raise
    finally:
        # a failure or Ctrl-C leaves no .tmp
        tmp.unlink(missing_ok=True)
    return file


def load_model(epoch, bare_model, optimizer, device, args):
    file = f"{args.ckpt_dir}/epoch_{epoch}.pt"
    # weights_only: the file cannot run code
    ckpt = torch.load(file, map_location=device, weights_only=True)
    bare_model.load_state_dict(ckpt["model_state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    # the load brought back the saved lr: set --lr again (a --resume may pass another)
    for group in optimizer.param_groups:
        group["lr"] = args.lr


def run_training(gpus, train_set, num_classes, first_epoch, args):
    device = torch.device("cuda:0" if gpus else "cpu")
    if args.max_steps:
        # --max-steps: shorter epochs, each over the same random part of the data
        keep = args.max_steps * args.batch_size
        train_set = Subset(train_set, torch.randperm(len(train_set))[:keep].tolist())
    dataloader = prepare_dataloader(train_set, gpus, args)
    # bare_model: what the checkpoints hold; model: what trains (maybe wrapped)
    bare_model = build_model(args, num_classes).to(device)
    if args.channels_last:
        bare_model = bare_model.to(memory_format=torch.channels_last)
    model = Bf16Autocast(bare_model) if args.amp else bare_model
    if gpus:
        # every visible GPU: at each step DataParallel copies the model from
        # GPU 0 to the others and splits the batch between them
        model = torch.nn.DataParallel(model)
    params = model.parameters()
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    steps = len(dataloader)
    line = (
        f"start | {Path(__file__).name} | gpus {gpus} | device {device}"
        f" | model {type(bare_model).__name__} | data {args.data or 'synthetic'}"
        f" ({len(train_set)} images) | batch {args.batch_size} | lr {args.lr}"
        f" | steps {steps} | epochs {first_epoch}-{args.epochs}"
        f" | ckpt_dir {args.ckpt_dir}"
    )
    if first_epoch > 1:
        line += f" | resuming from epoch_{first_epoch - 1}.pt"
    elif args.resume:
        line += " | no checkpoint to resume from"
    print(line)
    # fixed: the tutorial's range(1, 30) ran 29 epochs
    epochs = range(first_epoch, args.epochs + 1)
    # report() gets None if no epoch runs (--resume after the last one)
    loss = rate = path = None
    for epoch in epochs:
        # the tutorial's pattern: each epoch starts from the last one's checkpoint
        # (after --resume, the first from the newest in --ckpt-dir)
        if epoch > 1:
            load_model(epoch - 1, bare_model, optimizer, device, args)
        loss, rate = train(model, dataloader, optimizer, device, epoch, args)
        path = save_model(epoch, bare_model, optimizer, args)
        print(f"epoch {epoch}/{args.epochs} | loss {loss:.4f} | {rate:.0f} img/s")
    results = dict(
        epochs_run=len(epochs), final_loss=loss, images_per_sec=rate, checkpoint=path
    )
    report(results, steps, gpus, device, args)


def report(results, steps, gpus, device, args):
    """The done line, and --metrics-out: the results as JSON."""
    print(
        f"done | epochs_run {results['epochs_run']}"
        f" | final_loss {results['final_loss']}"
        f" | checkpoint {results['checkpoint']}"
    )
    if args.metrics_out:
        metrics = dict(
            script=Path(__file__).name,
            world_size=max(gpus, 1),
            device=device.type,
            steps=steps,
            **results,
        )
        Path(args.metrics_out).write_text(json.dumps(metrics, indent=1))


# --- loader workers (--workers): prepare_dataloader needs this section ---
class WorkerLoader(DataLoader):
    """A DataLoader whose workers a stop or a crash cannot leave behind: forked by
    a forkserver, started with Ctrl-C held, and ended with this process."""

    def __init__(self, *args, num_workers, **kwargs):
        if num_workers:
            # not forks: a fork can hang on a lock one of this process's threads held
            start_forkserver()
            # at exit, before multiprocessing joins them: a stopped worker never ends
            util.Finalize(None, continue_workers, exitpriority=0)
        super().__init__(
            *args,
            num_workers=num_workers,
            multiprocessing_context="forkserver" if num_workers else None,
            worker_init_fn=worker_init,
            **kwargs,
        )

    def __iter__(self):
        """Start this epoch's workers, with Ctrl-C and SIGTERM held meanwhile."""
        held = []
        for sig in signal.SIGINT, signal.SIGTERM:
            signal.signal(sig, lambda signum, frame: held.append(signum))
        try:
            batches = super().__iter__()
        except Exception:
            # a Ctrl-C also ends a starting forkserver, failing this start: stop anyway
            if not held:
                raise
            batches = None
        finally:
            for sig in signal.SIGINT, signal.SIGTERM:
                signal.signal(sig, exit_quietly)
        if not held:
            return batches
        # a stop came: end the workers now, ignoring further stops (left to Python's
        # exit, they outlived their queues)
        ignore_stops()
        del batches
        sys.exit(130)


def start_forkserver():
    """Start the forkserver that forks the loader workers (it imports for seconds)."""
    # this script first: its SIGINT line then covers the forkserver's `import torch`
    mp.set_forkserver_preload([Path(__file__).stem, "torch", "torchvision"])
    # it finds this script by name only if started in the script's folder
    cwd = os.getcwd()
    os.chdir(Path(__file__).parent)
    forkserver.ensure_running()
    os.chdir(cwd)


def worker_init(worker_id):
    """In each worker: quiet on Ctrl-C, and gone once its training process is."""
    # Ctrl-C reaches the workers too: the training process ends them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # no traceback when a Ctrl-C cuts a batch's handover (the training process
    # reports any real failure)
    sys.excepthook = lambda *exc_info: None
    # end the worker when the training process dies, even by SIGKILL (the worker's
    # OS parent is the forkserver, so torch's own check misses it)
    threading.Thread(target=exit_after_parent, daemon=True).start()


def exit_after_parent():
    """Wait for the training process (multiprocessing's parent), then end the worker."""
    mp.parent_process().join()
    os._exit(1)


def continue_workers():
    """At exit: wake any stopped worker, so that it acts on the SIGTERM that ends it."""
    for worker in mp.active_children():
        os.kill(worker.pid, signal.SIGCONT)


# --- end of loader workers ---
def exit_quietly(signum, frame):
    """Ctrl-C or SIGTERM: exit 130, without a traceback, and ignore any further stop."""
    ignore_stops()
    # SystemExit: unlike KeyboardInterrupt, it ends Python without a traceback
    sys.exit(130)


def ignore_stops():
    """Ctrl-C and SIGTERM do nothing from now on (with one pending, SIG_IGN warns)."""
    for sig in signal.SIGINT, signal.SIGTERM:
        signal.signal(sig, lambda signum, frame: None)


def positive(text):
    if int(text) < 1:
        raise ValueError(text)
    return int(text)


def nonempty(text):
    if not text:
        raise ValueError(text)
    return text


def learning_rate(text):
    # refused: with nan or inf every step trains to nan, and the run exits 0
    if not 0 <= float(text) < float("inf"):
        raise ValueError(text)
    return float(text)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="the CPU even with GPUs")
    p.add_argument("--metrics-out", type=nonempty, help="the results, as JSON")
    p.add_argument("--epochs", type=positive, default=30)
    p.add_argument("--batch-size", type=positive, default=64, help="split over GPUs")
    p.add_argument("--lr", type=learning_rate, default=0.01, help="learning rate")
    p.add_argument("--max-steps", type=positive, help="cuts each epoch to N steps")
    p.add_argument("--data", type=nonempty, help="an ImageFolder (else random images)")
    p.add_argument("--image-size", type=positive, default=224)
    # torchvision's classifiers, except two whose training output is a tuple
    archs = models.list_models(module=models, exclude=["googlenet", "inception*"])
    p.add_argument("--arch", default="resnet50", choices=archs)
    gpus = torch.cuda.device_count()
    # 4 loader workers a GPU, as in the tutorial
    p.add_argument("--workers", type=int, default=4 * gpus)
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--ckpt-dir", type=nonempty, default="model_checkpoints")
    p.add_argument("--resume", action="store_true", help="from the newest epoch_N")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    # fixed: each line reaches a log file (nohup, SLURM) when it is printed, not
    # when a buffer fills
    sys.stdout.reconfigure(line_buffering=True)
    if args.data and not Path(args.data).is_dir():
        sys.exit(f"error: --data {args.data}: no such folder")
    newest = newest_epoch(args)
    # a fresh run into a used folder: refused, or --resume would mix two runs
    if newest and not args.resume:
        last = f"{args.ckpt_dir}/epoch_{newest}.pt"
        sys.exit(
            f"error: {last} exists: add --resume to go on, or use another --ckpt-dir"
        )
    # a file made and removed: an unwritable --ckpt-dir fails now, not after an epoch
    try:
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.ckpt_dir).close()
    except OSError as e:
        sys.exit(f"error: --ckpt-dir {args.ckpt_dir}: {e.strerror}")
    # the same synthetic images and initial weights in every run
    torch.manual_seed(0)
    train_set, num_classes = load_datasets(args)
    # drop_last would leave no step at all
    if len(train_set) < args.batch_size:
        sys.exit(f"error: {len(train_set)} images, too few for one batch")
    # from here on, Ctrl-C and SIGTERM exit 130 quietly (a save removes its .tmp first)
    for sig in signal.SIGINT, signal.SIGTERM:
        signal.signal(sig, exit_quietly)
    # CUDA_VISIBLE_DEVICES chooses the GPUs
    gpus = 0 if args.cpu else torch.cuda.device_count()
    # epoch 1, or with --resume the one after the newest checkpoint
    run_training(gpus, train_set, num_classes, newest + 1, args)
    # done: a stop now would land in Python's exit hooks, and print a traceback
    ignore_stops()
