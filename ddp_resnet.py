"""DDP ResNet (AIME part 2, the DDP tutorial's checkpoints): rank 0 saves, every rank reloads.
torchrun --standalone --nproc-per-node=2 ddp_resnet.py --cpu --arch resnet18 --max-steps 10"""

import argparse
import io
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision.transforms as T
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
from torchvision import datasets, models

mp.set_forkserver_preload(["torchvision"])  # the loader workers' server imports it once, not each


def ddp_setup(local_rank: int, args: argparse.Namespace) -> torch.device:
    os.environ.setdefault("RANK", str(local_rank))  # spawned by launch(): rank = local rank
    cuda = torch.cuda.is_available() and not args.cpu  # fixed: not NCCL-only: gloo on CPU too
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before any collective, or every rank uses cuda:0
    backend, timeout = ("nccl" if cuda else "gloo"), timedelta(seconds=args.timeout)  # ends a hang
    dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop ends a save as Ctrl-C does
    return device


def print0(*args) -> None:
    if int(os.environ.get("RANK", 0)) == 0:  # global rank 0 (and the launcher, before any rank)
        print(*args, flush=True)


def load_datasets(args: argparse.Namespace) -> tuple:  # train, val (or None), classes
    size, imagenet = args.image_size, T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    resize = [T.Resize(size * 8 // 7), T.CenterCrop(size), T.ToTensor(), imagenet]  # the tutorial's
    if args.data:  # fixed: the tutorial's ImageFolder(root=, ...) is a syntax error
        train = datasets.ImageFolder(args.data, transform=T.Compose(resize))
    else:  # 12,800 random images, 256 distinct ones made once: no decoding
        images = TensorDataset(torch.randn(256, 3, size, size), torch.arange(256))  # by --seed
        train = Subset(images, [i % 256 for i in range(12800)])
        train.classes = [str(c) for c in range(256)]
    val = args.val_data and datasets.ImageFolder(args.val_data, T.Compose(resize))
    if val and val.classes != train.classes:
        raise ValueError("it holds other classes than the training data")
    return train, val or None, len(train.classes)


def build_model(args: argparse.Namespace, num_classes: int) -> torch.nn.Module:
    # fixed: pretrained=False is deprecated; weights=None is the same random init
    return models.get_model(args.arch, weights=None, num_classes=num_classes)


def train(model: DDP, dataloader, optimizer, epoch: int, steps: int, args) -> dict:
    dataloader.sampler.set_epoch(epoch)  # fixed: without it every epoch has the same order
    torch.manual_seed(hash((args.seed, epoch, dist.get_rank())))  # dropout, augmentation, workers
    device, batch = next(model.parameters()).device, args.batch_size * dist.get_world_size()
    total, began, shown = torch.zeros(2, device=device), time.monotonic(), time.monotonic()
    for step, (images, labels) in zip(range(1, steps + 1), dataloader, strict=False):
        images = images.to(device, non_blocking=True, memory_format=args.memory_format)
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):  # bf16: no scaler
            loss = torch.nn.functional.cross_entropy(model(images), labels.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages every rank's gradients here
        optimizer.step()
        total += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        if step % args.log_every == 0 or time.monotonic() - shown > 30:  # never quiet for long
            value, shown = loss.item(), time.monotonic()  # .item() waits for the device
            head = f"epoch {epoch}/{args.epochs} | step {step}/{steps} | loss {value:.4f}"
            print0(f"{head} | {step * batch / (shown - began):.0f} img/s | {shown - began:.1f} s")
    dist.all_reduce(total)  # fixed: every rank's steps, not rank 0's share alone
    loss, seconds = (total[0] / total[1]).item(), time.monotonic() - began  # after .item()
    return dict(final_loss=loss, images_per_sec=steps * batch / seconds, seconds=seconds)


@torch.no_grad()
def evaluate(model: DDP, val_set, args) -> dict:  # top-1; a DistributedSampler repeats images
    for buffer in model.module.buffers():  # BatchNorm's running statistics: rank 0's, as saved
        dist.broadcast(buffer, src=0)
    share = Subset(val_set, range(dist.get_rank(), len(val_set), dist.get_world_size()))
    device, counts = next(model.parameters()).device, torch.zeros(2, dtype=torch.int64)
    model.eval()
    for images, labels in DataLoader(share, args.batch_size, num_workers=args.workers):
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):  # no DDP hooks:
            predicted = model.module(images.to(device, memory_format=args.memory_format))
        counts += torch.tensor([(predicted.argmax(1).cpu() == labels).sum(), len(labels)])
    model.train()
    dist.all_reduce(counts := counts.to(device))  # [correct, seen] of every rank
    correct, seen = counts.tolist()
    return dict(val_accuracy=correct / seen, val_correct=correct, val_samples=seen)


def save_model(epoch: int, model: DDP, optimizer, args) -> str:  # atomic: tmp, fsync, rename
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"  # fixed: no file.touch(): torch.save makes it
    ckpt = dict(epoch=epoch, model_state_dict=model.module.state_dict())  # no "module." keys
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


def load_model(epoch: int, model: DDP, optimizer, args) -> None:  # every rank, rank 0's file
    dist.barrier()  # before the load, not after the save: it guards --resume's first load too
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"  # fixed: a cuda:0->cuda:rank map fails on CPU
    ckpt = torch.load(file, map_location=next(model.parameters()).device, weights_only=True)
    model.module.load_state_dict(ckpt["model_state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_state_dict"])


def run_training_process_on_given_gpu(local_rank: int, args: argparse.Namespace) -> None:
    device = ddp_setup(local_rank, args)
    mp.set_start_method("forkserver", force=True)  # loader workers: a fork of a gloo rank can hang
    try:
        torch.manual_seed(args.seed)  # the same synthetic images and initial weights on every rank
        train_set, val_set, num_classes = load_datasets(args)
        # fixed: --workers per rank (4 * GPUs each made 4 * GPUs**2); drop_last: BatchNorm needs 2
        kwargs = dict(num_workers=args.workers, pin_memory=device.type == "cuda", drop_last=True)
        sampler = DistributedSampler(train_set, seed=args.seed)  # each rank its shuffled share
        dataloader = DataLoader(train_set, args.batch_size, sampler=sampler, **kwargs)
        model = DDP(build_model(args, num_classes).to(device, memory_format=args.memory_format))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
        start = torch.tensor(args.start_epoch, device=device)
        dist.broadcast(start, src=0)  # rank 0's look at --ckpt-dir decides for every rank
        steps = min(len(dataloader), args.max_steps or len(dataloader))
        m = dict(script=Path(__file__).name, world_size=dist.get_world_size(), device=device.type)
        m.update(backend=dist.get_backend(), model=type(model.module).__name__, steps=steps)
        print0(line("start", m, *m), "|", args.todo)  # check_args's, on rank 0
        for epoch in range(start.item(), args.epochs + 1):  # fixed: range(1, 30) ran 29 epochs
            if epoch > 1:
                load_model(epoch - 1, model, optimizer, args)
            m.update(train(model, dataloader, optimizer, epoch, steps, args))
            if dist.get_rank() == 0:  # the global rank: LOCAL_RANK 0 is one writer per node
                m["checkpoint"] = save_model(epoch, model, optimizer, args)
            if val_set is not None:  # an empty share too: the others wait for its all_reduce
                m.update(evaluate(model, val_set, args))
            keys = "final_loss", "val_accuracy", "images_per_sec", "seconds"
            print0(line(f"epoch {epoch}/{args.epochs}", m, *keys))
        if val_set is not None and start > args.epochs:  # a finished run resumed: score it
            load_model(start.item() - 1, model, optimizer, args)
            m.update(evaluate(model, val_set, args))
        m["epochs_run"] = max(0, args.epochs + 1 - start.item())
        print0(line("done", m, "epochs_run", "final_loss", "val_accuracy", "checkpoint"))
        if dist.get_rank() == 0 and args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps(m, indent=1))
        del model  # before its process group goes: torch 2.11 (gloo) could hang at exit
        dist.destroy_process_group()
    except RuntimeError as e:  # a lost peer (gloo's, NCCL's words): let its own report come first
        time.sleep(3 * any(w in str(e) for w in ("by peer", "Broken pipe", "remote process")))
        raise


def line(head: str, m: dict, *keys: str) -> str:
    shown = {k: f"{m[k]:.4g}" if type(m[k]) is float else m[k] for k in keys if k in m}
    return " | ".join([head, *(f"{k} {v}" for k, v in shown.items())])


# --- launching and checks (the same in every DDP script of this collection) ---
def launch(main, args: argparse.Namespace) -> None:  # torchrun: we are one rank; else spawn
    def stop(*_) -> None:  # SIGTERM (kill) to the launcher: passed on to the ranks; Ctrl-C for us
        for p in [*mp.active_children(), mp.current_process()]:
            os.kill(p.pid, signal.SIGINT if p.pid == os.getpid() else signal.SIGTERM)

    try:
        if args.metrics_out and os.environ.get("RANK", "0") == "0":  # its writer, before training:
            Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
            open(args.metrics_out, "a").close()  # can it write there? if not, an OSError says why
        if "RANK" in os.environ:  # torchrun sets RANK, LOCAL_RANK...; a cluster's pod may set RANK
            return record(main)(int(os.environ.get("LOCAL_RANK", 0)), args)  # torchrun's summary
        if int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1:  # srun -n 2 python script.py
            sys.exit("error: srun -n N starts N separate jobs; run torchrun once per node")
        if 0 < torch.cuda.device_count() < args.nprocs and not args.cpu:
            sys.exit(f"error: --nprocs {args.nprocs}, but fewer GPUs here; use fewer, or --cpu")
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() // args.nprocs or 1))  # cores
        addr, port = os.environ.setdefault("MASTER_ADDR", "127.0.0.1"), os.getenv("MASTER_PORT", 0)
        store = dist.TCPStore(addr, int(port), is_master=True)  # fixed: not 12355; yours or free,
        os.environ.update(MASTER_PORT=str(store.port), WORLD_SIZE=str(args.nprocs))  # held by us:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # ranks join our store, as torchrun's
        signal.signal(signal.SIGINT, signal.default_int_handler)  # `cmd &` ignored it; so would
        signal.signal(signal.SIGTERM, stop)  # the ranks, whose death-of-parent signal it is
        mp.spawn(main, (args,), nprocs=args.nprocs)  # one rank fails: SIGTERM to the others
    except (mp.ProcessExitedException, mp.ProcessRaisedException, OSError, dist.DistError) as e:
        sys.exit(max(getattr(e, "exit_code", 0), 0) or f"error: {e}")  # a rank said why, or we do
    except KeyboardInterrupt:  # Ctrl-C, which every rank got too, or a stop (above)
        sys.exit(130)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return int(text)


def check_args(args: argparse.Namespace) -> None:  # one line each, before any rank starts
    try:  # ImageFolder: no folder, no class folders, a class without images; other classes
        train_set, _, num_classes = load_datasets(args)
    except (OSError, ValueError) as e:  # whose folder: --data's if it fails again on its own
        try:
            args.data and datasets.ImageFolder(args.data)
        except OSError:
            sys.exit(f"error: --data {args.data}: {e}")
        sys.exit(f"error: --val-data {args.val_data}: {e}")
    if len(train_set) < args.batch_size * int(os.environ.get("WORLD_SIZE", args.nprocs)):
        sys.exit(f"error: {len(train_set)} images, too few for --batch-size {args.batch_size}")
    saved = [f for f in Path(args.ckpt_dir).glob("epoch_*.pt") if f.stem[6:].isdigit()]
    file = max(saved, key=lambda f: int(f.stem[6:]), default=None)  # the newest
    if file and not args.resume:  # another run's: a later --resume would go on from it
        sys.exit(f"error: {file} exists: add --resume to go on from it, or use another --ckpt-dir")
    try:  # a file in the folder's place, a read-only disk; a damaged checkpoint, another model's
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
        if file:
            ckpt = torch.load(file, map_location="cpu", weights_only=True)["model_state_dict"]
            build_model(args, num_classes).load_state_dict(ckpt)
    except Exception as e:
        why = " ".join(str(e).split("WeightsUnpickler error:")[-1].split())[:300]  # one line
        sys.exit(f"error: cannot {f'resume from {file}' if file else 'make --ckpt-dir'}: {why}")
    args.start_epoch = int(file.stem[6:]) + 1 if file else 1
    args.todo = f"resuming from {file} | " * bool(file) + f"epochs {args.start_epoch}-{args.epochs}"
    if args.start_epoch > args.epochs:  # a finished run resumed: scored again with --val-data
        args.todo = f"nothing to train: {file} reached --epochs {args.epochs}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=positive, default=torch.cuda.device_count() or 2, help="ranks")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where GPUs exist")
    p.add_argument("--timeout", type=positive, default=300, help="seconds a rank waits for another")
    p.add_argument("--metrics-out", help="rank 0 writes the results here as JSON")
    p.add_argument("--epochs", type=positive, default=30)
    p.add_argument("--batch-size", type=positive, default=64, help="per process")
    p.add_argument("--lr", type=float, default=0.01, help="SGD, momentum 0.9, weight decay 1e-4")
    p.add_argument("--seed", type=int, default=0, help="initial weights, order, synthetic data")
    p.add_argument("--max-steps", type=positive, help="end each epoch after N steps")
    p.add_argument("--log-every", type=positive, default=10, help="a line every N steps")
    p.add_argument("--data", help="an ImageFolder root; without it, synthetic images")
    p.add_argument("--val-data", help="an ImageFolder root with --data's classes")
    p.add_argument("--image-size", type=positive, default=224)
    p.add_argument("--arch", default="resnet50", choices=models.list_models(models))
    p.add_argument("--workers", type=int, default=4 * torch.cuda.is_available(), help="per rank")
    p.add_argument("--amp", action="store_true", help="bf16 autocast, for GPUs")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format, for GPUs")
    p.add_argument("--ckpt-dir", default="model_checkpoints", help="rank 0 saves epoch_N.pt here")
    p.add_argument("--resume", action="store_true", help="go on after the newest epoch_N.pt")
    p.set_defaults(start_epoch=1, todo="")  # check_args's, where it runs: rank 0 has its start
    args = p.parse_args()
    args.memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    return args


if __name__ == "__main__":
    args = parse_args()
    if os.environ.get("LOCAL_RANK", "0") == "0":  # under torchrun one process a node checks and
        check_args(args)  # says why; the others wait for rank 0 in ddp_setup, or are stopped
    launch(run_training_process_on_given_gpu, args)
