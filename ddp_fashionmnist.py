#!/usr/bin/env python3
"""Data-parallel training of the SeqNet MLP on FashionMNIST, with distributed test accuracy.

Follows the "Data-Parallel Training" tutorial (SeqNet, mp.spawn) one to one and fixes its bugs.

    python ddp_fashionmnist.py                         # one process per GPU, or 2 on CPU
    python ddp_fashionmnist.py --data /usr/share/datasets/fashion-mnist   # Debian's, offline
    torchrun --standalone --nproc-per-node=2 ddp_fashionmnist.py --cpu
    python ddp_fashionmnist.py --synthetic --epochs 1  # smoke run on random data

Rank 0 prints a start line (`start | 2 processes | gloo on CPU | SeqNet | ...`: the data, the
batch, steps and epochs), one line per epoch (and a progress line at least every 30 s where an
epoch takes longer) and a final line:
    epoch 10/10 | loss 0.4991 | 19591 img/s | 3.1 s
    done | test_accuracy 0.8536 (10000 images) | world_size 2 | backend gloo
"""
import argparse
import ctypes
import gzip
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while the slow imports below run: exit 130, no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(130))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# fixed: the tutorial imports mlflow and never uses it
IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",  # FashionMNIST's four files
       "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


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


def load_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    """Train and test sets in memory, images scaled to [0, 1] as ToTensor() would."""
    if args.synthetic:  # random data of FashionMNIST's shape and sizes
        g = torch.Generator().manual_seed(args.seed)
        return tuple(TensorDataset(torch.rand(n, 1, 28, 28, generator=g),
                                   torch.randint(10, (n,), generator=g)) for n in (60000, 10000))
    files = idx_files(Path(args.data))
    return tuple(TensorDataset(read_idx(files[f"{split}-images-idx3-ubyte"]).unsqueeze(1) / 255,
                               read_idx(files[f"{split}-labels-idx1-ubyte"]).long())
                 for split in ("train", "t10k"))


def prepare_dataloader(dataset: Dataset, batch_size: int, seed: int, pin_memory: bool):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=pin_memory,  # fixed: the tutorial always pins; that only helps copies to a GPU
        shuffle=False,  # the sampler shuffles
        sampler=DistributedSampler(dataset, seed=seed),  # each rank its own share
    )


class SeqNet(nn.Module):
    def __init__(self, input_size: int, hidden_size1: int, hidden_size2: int, output_size: int):
        super().__init__()
        self.lin1 = nn.Linear(input_size, hidden_size1)
        self.lin2 = nn.Linear(hidden_size1, hidden_size2)
        self.lin3 = nn.Linear(hidden_size2, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        x = self.lin1(x)
        x = torch.sigmoid(x)
        x = self.lin2(x)
        x = F.log_softmax(x, dim=1)  # the tutorial's: an odd activation, kept to match it
        return self.lin3(x)


def train(model: nn.Module, train_loader: DataLoader, loss_function: nn.Module,
          optimizer: torch.optim.Optimizer, device: torch.device, args: argparse.Namespace) -> dict:
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    steps, average_loss = min(len(train_loader), args.max_steps or len(train_loader)), float("nan")
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # fixed: without it every epoch has the same order
        model.train()
        start, running = time.perf_counter(), torch.zeros(2, device=device)  # [loss sum, steps]
        last = start
        for i, (images, labels) in enumerate(train_loader):
            if i == args.max_steps:
                break
            # fixed: no second torch.div(images, 255.): load_datasets scaled them once
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = loss_function(model(images), labels)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if time.perf_counter() - last >= 30:  # a slow machine: never quiet for long
                last, done = time.perf_counter(), i + 1
                rate = done * args.batch_size * dist.get_world_size() / (last - start)
                print0(f"epoch {epoch + 1}/{args.epochs} | step {done}/{steps} | loss "
                       f"{loss.item():.4f} | {rate:.0f} img/s | eta "
                       f"{duration((steps - done) * (last - start) / done)}{args.tag}")
        dist.all_reduce(running)  # fixed: the tutorial printed rank 0's share; this is everyone's
        average_loss, seconds = (running[0] / running[1]).item(), time.perf_counter() - start
        print0(f"epoch {epoch + 1}/{args.epochs} | loss {average_loss:.4f} | "
               f"{running[1] * args.batch_size / seconds:.0f} img/s | {seconds:.1f} s{args.tag}")
    return {"epochs_run": args.epochs, "steps": steps * args.epochs, "final_loss": average_loss}


@torch.no_grad()
def test(model: nn.Module, test_set: Dataset, device: torch.device, batch_size: int):
    """Correct answers and images over the whole test set, each image counted once.

    A DistributedSampler would pad the last share with repeats so all ranks get as many: right
    for training, wrong for a score. Here each rank takes every world_size-th image (shares may
    differ by one) and one all_reduce after the loop adds up [correct, seen]."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)  # [correct, seen]
    for images, labels in DataLoader(Subset(test_set, range(rank, len(test_set), world_size)),
                                     batch_size=batch_size):
        images, labels = images.to(device), labels.to(device)
        counts[0] += (model(images).argmax(1) == labels).sum()
        counts[1] += len(labels)
    dist.all_reduce(counts)
    return counts.tolist()


def main(local_rank: int, args: argparse.Namespace) -> None:
    device = ddp_setup(local_rank, args)
    try:
        # fixed: the tutorial downloads in every rank at once; one process per machine made the
        # data ready before the ranks started (see __main__), and the others wait for it here
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)  # NCCL: ours
        train_set, test_set = load_datasets(args)
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        my_net = SeqNet(784, 200, 200, 10).to(device)
        optimizer = torch.optim.Adam(my_net.parameters(), lr=args.lr)
        loss_function = nn.CrossEntropyLoss()
        train_loader = prepare_dataloader(train_set, args.batch_size, args.seed,
                                          pin_memory=device.type == "cuda")
        print_start(device, train_loader, args)  # what runs where, before the first step
        results = train(my_net, train_loader, loss_function, optimizer, device, args)
        correct, seen = test(my_net, test_set, device, args.batch_size)
        print0(f"done | test_accuracy {correct / seen:.4f} ({seen} images) | world_size "
               f"{dist.get_world_size()} | backend {dist.get_backend()}{args.tag}")
        if dist.get_rank() == 0 and args.save_model:  # SeqNet's own keys, no "module." prefix
            torch.save(my_net.state_dict(), f"{args.save_model}.tmp")
            os.replace(f"{args.save_model}.tmp", args.save_model)  # never half a file at that name
        if dist.get_rank() == 0 and args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps({
                "script": "ddp_fashionmnist.py", "world_size": dist.get_world_size(),
                "backend": dist.get_backend(), "device": device.type,
                "data": "synthetic" if args.synthetic else args.data, **results,
                "test_accuracy": correct / seen, "test_correct": correct, "test_samples": seen},
                indent=1))
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


def print_start(device: torch.device, train_loader: DataLoader, args: argparse.Namespace):
    steps = min(len(train_loader), args.max_steps or len(train_loader))
    print0(f"start | {where(device)} | SeqNet | {'synthetic' if args.synthetic else args.data} "
           f"{len(train_loader.dataset)} images | batch {args.batch_size} x "
           f"{dist.get_world_size()} | {steps} steps x {args.epochs} epochs")


def idx_files(root: Path) -> dict:
    """The IDX files, .gz or not, in root (e.g. Debian's folder) or in root/FashionMNIST/raw
    (torchvision's download), whichever of the two holds more of them."""
    return max(({name: file for name in IDX for file in (folder / name, folder / f"{name}.gz")
                 if file.is_file()} for folder in (root, root / "FashionMNIST" / "raw")), key=len)


def read_idx(path: Path) -> torch.Tensor:
    """MNIST's format: two zero bytes, a type byte, the number of dimensions, each size as a
    big-endian uint32, then the uint8 data."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        raw = f.read()
    shape = struct.unpack(f">{raw[3]}I", raw[4:4 + 4 * raw[3]])
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=4 + 4 * raw[3]).view(shape)


def prepare_data(root: Path) -> None:
    """Download FashionMNIST into root if it is not there, then read every file once: any
    problem is one error line now, not a traceback in every rank later."""
    if not idx_files(root):
        try:
            from torchvision import datasets  # only for the download
            for train in (True, False):
                datasets.FashionMNIST(str(root), train=train, download=True)
        except Exception as e:  # no network, no write permission, a mirror down...
            reason = " ".join(str(e).split())  # torchvision's message spans lines
            sys.exit(f"error: FashionMNIST is not in {root} and the download failed ({reason}); "
                     f"pass --data with the four IDX files (Debian: apt install "
                     f"dataset-fashion-mnist, then --data /usr/share/datasets/fashion-mnist), "
                     f"or --synthetic")
    files = idx_files(root)
    if len(files) < len(IDX):  # a partial copy: a download over it would hide the problem
        sys.exit(f"error: {root} lacks {', '.join(n for n in IDX if n not in files)}; add the "
                 f"missing file(s) (.gz or not), or delete the folder so a download fills it")
    for file in files.values():
        try:
            read_idx(file)
        except Exception as e:  # truncated or damaged
            sys.exit(f"error: {file} is unreadable or truncated ({e}); delete it, download again")


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=100, help="per process")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, help="stop each epoch after N steps (smoke runs)")
    p.add_argument("--data", default="data", help="torchvision root, or the four IDX files' folder")
    p.add_argument("--synthetic", action="store_true", help="random data (smoke runs)")
    p.add_argument("--save-model", help="rank 0 saves the trained weights here")
    args = p.parse_args()
    args.tag = " | synthetic data" if args.synthetic else ""  # on every line: never mistaken
    return args


if __name__ == "__main__":
    args = parse_args()
    check_args(args, positive=("epochs", "batch_size", "lr", "max_steps"))
    if not args.synthetic and os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine
        prepare_data(Path(args.data))
    launch(main, args)
