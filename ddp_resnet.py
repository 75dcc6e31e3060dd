"""DDP ResNet (AIME "Multi GPU training with PyTorch", part 2: DDP).

    python ddp_resnet.py          # one process per GPU, or 2 on a CPU
    torchrun --standalone --nproc-per-node=2 ddp_resnet.py --cpu --arch resnet18
    python ddp_resnet.py --cpu --arch resnet18 --image-size 32 --epochs 2 --max-steps 3

Rank 0 prints `start | ...`, progress lines, a line per epoch and `done | ...`.
Run it again with --resume to go on after the newest checkpoint in --ckpt-dir.
"""

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing import forkserver, util
from pathlib import Path

# Ctrl-C while torch imports (seconds): exit at once, without a traceback;
# launch() and ddp_setup put their own handlers in later
signal.signal(signal.SIGINT, signal.SIG_DFL)
# torchrun's pid for stop_after_launcher, read now: torchrun may die while torch loads
LAUNCHER = os.getppid()

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision.transforms as T
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import (
    ConcatDataset,
    DataLoader,
    DistributedSampler,
    Subset,
    TensorDataset,
)
from torchvision import datasets, models


def ddp_setup(local_rank, args):
    """Join the process group, then take over Ctrl-C; return this rank's device."""
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        # before the first collective, or every rank would use cuda:0
        torch.cuda.set_device(device)
    # MASTER_ADDR, MASTER_PORT and WORLD_SIZE: from torchrun, or from launch()
    dist.init_process_group(
        # fixed: the tutorial hard-codes NCCL, which needs GPUs; gloo runs on CPUs
        "nccl" if cuda else "gloo",
        # torchrun's RANK; a spawned rank (one node) is numbered by its local_rank
        rank=int(os.environ.get("RANK") or local_rank),
        world_size=int(os.environ["WORLD_SIZE"]),
        # a lost rank ends the job after --timeout instead of hanging it
        timeout=timedelta(seconds=args.timeout),
        # NCCL: binds this rank's GPU to the group, for barrier() too (gloo: none)
        device_id=device if cuda else None,
    )
    # Ctrl-C and SIGTERM ended the rank at once until now, even in the wait above;
    # from here on they let the clean-up run, then exit 130 (see exit_quietly)
    for sig in signal.SIGINT, signal.SIGTERM:
        signal.signal(sig, exit_quietly)
    return device


def print0(*args, **kwargs):
    if dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def fail(message):
    """Exit 1, rank 0 printing why. Call it in every rank at the same point: a rank
    that exits alone leaves the others waiting until --timeout."""
    print0(f"error: {message}", file=sys.stderr)
    dist.destroy_process_group()
    sys.exit(1)


def load_datasets(args):
    """The training set, the validation set (or None), the number of classes."""
    size = args.image_size
    # the tutorial's Resize(256), CenterCrop(224), scaled to --image-size
    preprocess = T.Compose(
        [
            T.Resize(size * 256 // 224),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    if args.data:
        # fixed: the tutorial's `ImageFolder(root=, ...)` is a SyntaxError
        train_set = datasets.ImageFolder(args.data, transform=preprocess)
        classes = train_set.classes
    else:
        # no --data: random images to try the script on; 256 of them, each its own
        # class, repeated 50 times, so that the loss falls as the model learns them
        images = TensorDataset(torch.randn(256, 3, size, size), torch.arange(256))
        train_set = ConcatDataset([images] * 50)
        classes = list(range(256))
    val_set = None
    if args.val_data:
        val_set = datasets.ImageFolder(args.val_data, transform=preprocess)
        # the same classes in the same order, or the labels mean other things
        if val_set.classes != classes:
            fail(f"--val-data {args.val_data}: its classes are not --data's")
    return train_set, val_set, len(classes)


def build_model(args, num_classes):
    # fixed: pretrained=False is deprecated; weights=None is the same
    return models.get_model(args.arch, weights=None, num_classes=num_classes)


def prepare_dataloader(dataset, device, args):
    # a DataLoader whose workers a stop or a crash cannot leave behind (WorkerLoader)
    return WorkerLoader(
        dataset,
        args.batch_size,
        # each rank its own shuffled share of the training set
        sampler=DistributedSampler(dataset, seed=args.seed),
        # fixed: --workers per rank, not the tutorial's 4 * GPUs in each rank
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        # BatchNorm cannot train on a last batch of 1 image
        drop_last=True,
    )


def train(model, dataloader, optimizer, device, epoch, args):
    """One epoch; the loss averaged over every rank, and images/s."""
    # fixed: without set_epoch every epoch has the same order
    dataloader.sampler.set_epoch(epoch)
    # a seed per epoch and rank: random draws (dropout, random crops) in a resumed
    # run are then those of an unbroken run
    torch.manual_seed(args.seed + 1000 * epoch + dist.get_rank())
    global_batch = args.batch_size * dist.get_world_size()
    steps = len(dataloader)
    # the epoch's summed loss, kept on the device for the all_reduce below
    loss_sum = torch.zeros((), device=device)
    began = last_print = time.monotonic()
    for step, (images, labels) in enumerate(dataloader, start=1):
        # non_blocking: the copy of a pinned batch overlaps the GPU's work
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad()
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):
            outputs = model(images)
            loss = torch.nn.functional.cross_entropy(outputs, labels)
        # DDP averages every rank's gradients here
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        # a line every 10 steps, at the last, and at least every 30 s
        if step % 10 == 0 or step == steps or time.monotonic() - last_print > 30:
            batch_loss = loss.item()
            now = time.monotonic()
            rate = step * global_batch / (now - began)
            print0(
                f"epoch {epoch}/{args.epochs} | step {step}/{steps}"
                f" | loss {batch_loss:.4f} | {rate:.0f} img/s"
            )
            last_print = now
    # fixed: the tutorial prints rank 0's loss alone; this is every rank's mean
    dist.all_reduce(loss_sum)
    mean_loss = loss_sum.item() / steps / dist.get_world_size()
    rate = steps * global_batch / (time.monotonic() - began)
    return mean_loss, rate


@torch.no_grad()
def evaluate(model, val_set, device, args):
    """Top-1 accuracy over the validation set, each image counted once."""
    # this rank's share, every world_size-th image: unlike a DistributedSampler,
    # it pads nothing, so each image is counted once
    share = Subset(val_set, range(dist.get_rank(), len(val_set), dist.get_world_size()))
    # rank 0's BatchNorm statistics in every rank (each rank's steps updated its own)
    for buffer in model.module.buffers():
        dist.broadcast(buffer, src=0)
    correct = seen = 0
    model.eval()
    for images, labels in DataLoader(share, args.batch_size):
        # model.module: ranks' batch counts differ, and DDP's forward would wait for all
        logits = model.module(images.to(device))
        correct += (logits.argmax(1) == labels.to(device)).sum().item()
        seen += len(labels)
    model.train()
    # summed over the ranks; one with no images adds 0 and 0
    counts = torch.tensor([correct, seen], device=device)
    dist.all_reduce(counts)
    correct, seen = counts.tolist()
    return dict(val_accuracy=correct / seen, val_correct=correct, val_samples=seen)


def newest_epoch(args):
    """N of the newest epoch_N.pt in --ckpt-dir; 0 if there is none."""
    # epoch_1.pt, epoch_2.pt, ...: a name like epoch_best.pt is not one of ours
    files = Path(args.ckpt_dir).glob("epoch_[1-9]*.pt")
    names = [file.stem.removeprefix("epoch_") for file in files]
    return max([int(n) for n in names if n.isdecimal()], default=0)


def save_model(epoch, model, optimizer, args):
    """Atomic: written to a .tmp file, fsynced, then renamed to epoch_N.pt."""
    file = f"{args.ckpt_dir}/epoch_{epoch}.pt"
    # fixed: the tutorial's file.touch() left an empty checkpoint if the save failed
    tmp = Path(f"{file}.tmp")
    ckpt = dict(
        epoch=epoch,
        # model.module: the bare model's keys, without "module."
        model_state_dict=model.module.state_dict(),
        optimizer_state_dict=optimizer.state_dict(),
    )
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
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


def load_model(epoch, model, optimizer, device, args):
    """Every rank loads the checkpoint that rank 0 saved."""
    # wait until rank 0 has saved it
    dist.barrier()
    file = f"{args.ckpt_dir}/epoch_{epoch}.pt"
    # fixed: onto this rank's own device; the tutorial maps cuda:0 to cuda:rank,
    # which fails on a CPU
    ckpt = torch.load(file, map_location=device, weights_only=True)
    model.module.load_state_dict(ckpt["model_state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    # the lr is --lr's, not the checkpoint's: a --resume may change it
    for group in optimizer.param_groups:
        group["lr"] = args.lr


def run_training_process_on_given_gpu(local_rank, args):
    device = ddp_setup(local_rank, args)
    # one seed in every rank: the same synthetic images and --max-steps subset
    torch.manual_seed(args.seed)
    train_set, val_set, num_classes = load_datasets(args)
    if args.max_steps:
        # --max-steps N: N global batches an epoch, from one random part of the data
        keep = args.max_steps * args.batch_size * dist.get_world_size()
        train_set = Subset(train_set, torch.randperm(len(train_set))[:keep].tolist())
    loader = prepare_dataloader(train_set, device, args)
    if len(loader) == 0:
        fail(f"{len(train_set)} images: too few for --batch-size {args.batch_size}")
    first_epoch = decide_first_epoch(device, args)
    model = build_model(args, num_classes).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    # unlike the tutorial, no device_ids=[rank]: DDP takes the model's device, a CPU too
    model = DDP(model)
    params = model.parameters()
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    print_start(model, len(loader), len(train_set), first_epoch, device, args)
    # fixed: the tutorial's range(1, 30) ran 29 epochs
    epochs = range(first_epoch, args.epochs + 1)
    # report() gets None if no epoch runs (--resume after the last one)
    loss = rate = path = None
    scores = {}
    for epoch in epochs:
        # the tutorial's lesson: each epoch, every rank loads the checkpoint rank 0
        # saved last (after --resume, the newest in --ckpt-dir)
        if epoch > 1:
            load_model(epoch - 1, model, optimizer, device, args)
        loss, rate = train(model, loader, optimizer, device, epoch, args)
        line = f"epoch {epoch}/{args.epochs} | loss {loss:.4f} | {rate:.0f} img/s"
        # fixed: global rank 0 saves; the tutorial's local rank 0 saved once a node
        if dist.get_rank() == 0:
            path = save_model(epoch, model, optimizer, args)
        if val_set is not None:
            scores = evaluate(model, val_set, device, args)
            line += f" | val_accuracy {scores['val_accuracy']:.4f}"
            line += f" ({scores['val_samples']} images)"
        print0(line)
    results = dict(
        epochs_run=len(epochs), final_loss=loss, images_per_sec=rate, checkpoint=path
    )
    report(results | scores, len(loader), device, args)
    # a workaround: free DDP before the group, or gloo may hang at exit (torch 2.11)
    del model
    dist.destroy_process_group()


def decide_first_epoch(device, args):
    """Epoch 1, or with --resume the one after the newest checkpoint. Rank 0 decides
    (another node may see another disk), and its broadcast tells every rank."""
    found = torch.tensor(newest_epoch(args), device=device)
    dist.broadcast(found, src=0)
    newest = found.item()
    # a fresh run into a used folder: refused, or --resume would mix two runs
    if newest and not args.resume:
        last = f"{args.ckpt_dir}/epoch_{newest}.pt"
        fail(f"{last} exists: add --resume to go on, or use another --ckpt-dir")
    return newest + 1


def print_start(model, steps, num_images, first_epoch, device, args):
    world_size = dist.get_world_size()
    line = (
        f"start | {Path(__file__).name} | world_size {world_size}"
        f" | backend {dist.get_backend()} | device {device}"
        f" | model {type(model.module).__name__}"
        f" | data {args.data or 'synthetic'} ({num_images} images)"
        f" | batch {args.batch_size} x {world_size} | lr {args.lr} | steps {steps}"
        f" | epochs {first_epoch}-{args.epochs} | ckpt_dir {args.ckpt_dir}"
    )
    if first_epoch > 1:
        line += f" | resuming from epoch_{first_epoch - 1}.pt"
    elif args.resume:
        line += " | no checkpoint to resume from"
    print0(line)


def report(results, steps, device, args):
    """The done line, and rank 0's --metrics-out (JSON)."""
    print0(
        f"done | epochs_run {results['epochs_run']}"
        f" | final_loss {results['final_loss']}"
        f" | checkpoint {results['checkpoint']}"
    )
    if dist.get_rank() == 0 and args.metrics_out:
        metrics = dict(
            script=Path(__file__).name,
            world_size=dist.get_world_size(),
            backend=dist.get_backend(),
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


# --- launching: start the ranks, stop them cleanly; `optional:` lines may go ---
def launch(fn, args):
    """Run fn(local_rank, args) once in each rank."""
    if os.environ.get("RANK"):
        # torchrun (or a pod that sets RANK) started this process as one rank
        local_rank = int(os.environ.get("LOCAL_RANK") or 0)
        return run_rank(local_rank, fn, args)
    # optional: each rank a share of the cores, not all (the ranks inherit this)
    if not os.environ.get("OMP_NUM_THREADS"):
        threads = max(1, os.cpu_count() // args.nprocs)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    # fixed: a free port from the system (port 0), not the tutorial's 12355. Held
    # open until the end, so that no other program takes it before rank 0's store
    # binds it too (which SO_REUSEADDR on both allows)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    # read by ddp_setup; set here, so that a WORLD_SIZE in the shell cannot change it
    os.environ["WORLD_SIZE"] = str(args.nprocs)
    # Ctrl-C, or a SIGTERM to this process alone (`kill PID`): stop every rank
    for sig in signal.SIGINT, signal.SIGTERM:
        signal.signal(sig, terminate_ranks)
    processes = mp.spawn(run_rank, (fn, args), nprocs=args.nprocs, join=False)
    # wait for every rank; once one fails, the others get 5 s to finish printing why
    # before they are stopped (join=True would stop them at once)
    try:
        while not processes.join(grace_period=5):
            pass
    except mp.ProcessExitedException as e:
        # optional: exit with the failed rank's own code (a refusal's, say); a
        # negative one means a signal killed it, and torch's error names the signal
        if e.exit_code < 0:
            raise
        sys.exit(e.exit_code)
    # the ranks are done: a late Ctrl-C must not turn success into a traceback
    ignore_stops()


# optional: @record puts a rank's traceback in torchrun's failure report
@record
def run_rank(local_rank, fn, args):
    """Run fn(local_rank, args) in this rank; end the rank if its launcher dies."""
    # optional: end this rank if its launcher dies, even inside init_process_group
    threading.Thread(target=stop_after_launcher, daemon=True).start()
    try:
        fn(local_rank, args)
    finally:
        # Ctrl-C ignored from here: it could only print a traceback at exit, or cut
        # short the error file that @record writes (torchrun then fails to read it)
        ignore_stops()


def terminate_ranks(signum, frame):
    """Stop every rank (SIGTERM), then exit 130 as they do."""
    for process in mp.active_children():
        process.terminate()
        # a rank stopped (SIGSTOP) acts on SIGTERM only once it runs again
        os.kill(process.pid, signal.SIGCONT)
    exit_quietly(signum, frame)


def stop_after_launcher():
    """Poll this rank's parent, its launcher; once it has ended, stop as on SIGTERM."""
    parent = mp.parent_process()
    # spawned: launch(), even if it died before this rank's imports; torchrun: LAUNCHER
    launcher = parent.pid if parent else LAUNCHER
    while os.getppid() == launcher:
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)


def exit_quietly(signum, frame):
    """Ctrl-C or SIGTERM: exit 130, without a traceback, and ignore any further stop."""
    ignore_stops()
    # SystemExit: unlike KeyboardInterrupt, it ends Python without a traceback
    sys.exit(130)


def ignore_stops():
    """Ctrl-C and SIGTERM do nothing from now on (with one pending, SIG_IGN warns)."""
    for sig in signal.SIGINT, signal.SIGTERM:
        signal.signal(sig, lambda signum, frame: None)


# --- end of launching ---
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
    gpus = torch.cuda.device_count()
    p.add_argument("--nprocs", type=positive, default=gpus or 2)
    p.add_argument("--cpu", action="store_true", help="gloo even with GPUs")
    p.add_argument("--timeout", type=positive, default=300, help="seconds")
    p.add_argument("--metrics-out", type=nonempty, help="rank 0's results, as JSON")
    p.add_argument("--epochs", type=positive, default=30)
    p.add_argument("--batch-size", type=positive, default=64, help="per rank")
    p.add_argument("--lr", type=learning_rate, default=0.01, help="learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive, help="cuts each epoch to N steps")
    p.add_argument("--data", type=nonempty, help="an ImageFolder (else random images)")
    p.add_argument("--val-data", type=nonempty, help="ImageFolder of --data's classes")
    p.add_argument("--image-size", type=positive, default=224)
    # torchvision's classifiers, except two whose training output is a tuple
    archs = models.list_models(module=models, exclude=["googlenet", "inception*"])
    p.add_argument("--arch", default="resnet50", choices=archs)
    p.add_argument("--workers", type=int, default=4 if gpus else 0, help="per rank")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--ckpt-dir", type=nonempty, default="model_checkpoints")
    p.add_argument("--resume", action="store_true", help="from the newest epoch_N")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    if args.data and not Path(args.data).is_dir():
        sys.exit(f"error: --data {args.data}: no such folder")
    # a file made and removed: an unwritable --ckpt-dir fails now, not after an epoch
    try:
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.ckpt_dir).close()
    except OSError as e:
        sys.exit(f"error: --ckpt-dir {args.ckpt_dir}: {e.strerror}")
    launch(run_training_process_on_given_gpu, args)
