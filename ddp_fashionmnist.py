#!/usr/bin/env python3
"""Data-parallel training of the SeqNet MLP on FashionMNIST, with distributed test accuracy.

Follows the "Data-Parallel Training" tutorial (SeqNet, mp.spawn) one to one and fixes its bugs.

    python ddp_fashionmnist.py                               # one process per GPU, or 2 on CPU
    python ddp_fashionmnist.py --cpu --nprocs 2 --data /usr/share/datasets/fashion-mnist
    torchrun --standalone --nproc-per-node=2 ddp_fashionmnist.py --cpu
    python ddp_fashionmnist.py --synthetic --epochs 1        # smoke run on random data

Rank 0 prints one line per epoch and a final line:
    epoch 10/10 | loss 0.4690 | 21000 img/s | 2.9 s
    done | test_accuracy 0.8351 (10000 images) | world_size 2 | backend gloo
"""
import argparse
import gzip
import json
import os
import pickle
import socket
import struct
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# fixed: the tutorial imports mlflow but never uses it; left out.
IDX_FILES = {  # the four raw files, as torchvision and Debian's dataset-fashion-mnist name them
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


# --- helpers repeated on purpose in every DDP script of the collection: keep them identical ---
def print0(*args) -> None:
    """Print from global rank 0 only (RANK is unset before the group exists)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


def free_port() -> int:
    """A port nothing listens on now, so runs never collide on a hard-coded 12355."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_setup(local_rank: int, nprocs: int, cpu: bool, timeout: float) -> torch.device:
    """Join torchrun's process group, or the one our mp.spawn children form."""
    if "RANK" not in os.environ:  # spawned by launch(), not by torchrun
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs))
    if torch.cuda.is_available() and not cpu:
        torch.cuda.set_device(local_rank)  # before any collective, or every rank uses cuda:0
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"  # gloo: NCCL needs a GPU per process
    level = dist.get_debug_level()
    if backend == "gloo" and level == dist.DebugLevel.DETAIL:
        # torch bug (seen in 2.11 to 2.14): DDP's constructor segfaults on a gloo group that
        # TORCH_DISTRIBUTED_DEBUG=DETAIL wrapped for collective checks. Leave the group unwrapped.
        dist.set_debug_level(dist.DebugLevel.INFO)
    # A finite timeout turns a dead or missing rank into an error instead of a hang.
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    dist.set_debug_level(level)  # DDP's own DETAIL checks stay on
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1
        # Ranks on one machine share its cores: one thread pool each, not N pools of all cores.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    return device


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(fn, args: argparse.Namespace) -> None:
    """Run fn(local_rank, args) in every process: under torchrun directly, else via mp.spawn."""
    if "RANK" in os.environ:  # torchrun set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*: spawn nothing
        fn(int(os.environ["LOCAL_RANK"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    context = mp.spawn(fn, args=(args,), nprocs=args.nprocs, join=False)
    try:
        # Once a rank fails the others get 3 s, then SIGTERM, then SIGKILL: mp.spawn's default
        # waits 30 s for a rank that ignores SIGTERM (a stopped one, say).
        while not context.join(grace_period=3):
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code > 0:  # the rank printed its own error line
            sys.exit(e.exit_code)
        sys.exit(f"error: rank {e.error_index} was killed by {e.signal_name}; the other ranks were stopped")
    except mp.ProcessRaisedException:
        # Show every rank's traceback, not the launcher's: the first failure noticed is often a
        # peer that only lost its connection to the rank that really failed.
        failed = []
        for rank, path in enumerate(context.error_files):
            if os.path.exists(path):  # written by a rank that raised
                with open(path, "rb") as f:
                    print(f"-- rank {rank}:\n{pickle.load(f).strip()}", file=sys.stderr)
                os.remove(path)
                failed.append(str(rank))
        sys.exit(f"error: rank {', '.join(failed)} failed (above); the other ranks were stopped")


def default_nprocs() -> int:
    return torch.cuda.device_count() or 2


def check_launch(args: argparse.Namespace) -> None:
    """Refuse impossible launches before any process starts."""
    if "RANK" in os.environ:
        return  # torchrun decides the processes; --nprocs is ignored
    if args.nprocs < 1:
        sys.exit(f"error: --nprocs must be at least 1, got {args.nprocs}")
    gpus = 0 if args.cpu else torch.cuda.device_count()
    if gpus and args.nprocs > gpus:
        sys.exit(f"error: --nprocs {args.nprocs} but only {gpus} GPU(s) visible; use --nprocs {gpus} or --cpu")
    if args.timeout <= 0:
        sys.exit(f"error: --timeout must be positive, got {args.timeout}")
    if "MASTER_PORT" in os.environ:  # yours, honoured: but rank 0 must be able to listen on it
        try:
            with socket.socket() as s:
                s.bind((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])))
        except (OSError, ValueError) as e:
            sys.exit(f"error: MASTER_PORT={os.environ['MASTER_PORT']} cannot be used here ({getattr(e, 'strerror', None) or e}); "
                     f"unset it and a free port is picked")


def write_json(path: str, obj: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
# --- end of the repeated helpers ---


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


def find_idx_files(root: Path) -> dict:
    """The IDX files (.gz or not) in root itself (e.g. Debian's folder) or in root/FashionMNIST/raw
    (where torchvision downloads them), from whichever of the two holds more of them."""
    best = {}
    for folder in (root, root / "FashionMNIST" / "raw"):
        found = {}
        for key, name in IDX_FILES.items():
            for candidate in (folder / name, folder / f"{name}.gz"):
                if candidate.is_file():
                    found[key] = candidate
                    break
        best = max(best, found, key=len)
    return best


def prepare_data(root: Path) -> str:
    """Make the dataset ready (download when missing); return '' or what went wrong."""
    files = find_idx_files(root)
    if not files:
        problem = download(root)
        if problem:
            return problem
        files = find_idx_files(root)
    if len(files) < len(IDX_FILES):  # a partial copy: downloading over it would hide the problem
        missing = [name for key, name in IDX_FILES.items() if key not in files]
        return (f"{next(iter(files.values())).parent} lacks {', '.join(missing)}; add the missing "
                f"file(s) (.gz or not), or delete the folder so a download fills it")
    try:  # read everything once here, so a damaged file is one error before training starts
        for path in files.values():
            read_idx(path)
    except ValueError as e:
        return str(e)
    return ""


def download(root: Path) -> str:
    if root.exists() and not root.is_dir():
        return f"--data {root} is not a folder"
    try:
        from torchvision import datasets  # only needed for the download
        for train in (True, False):
            datasets.FashionMNIST(root=str(root), train=train, download=True)
    except Exception as e:  # no network, no write permission, a mirror down...
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        return (f"FashionMNIST not found in {root} and the download failed ({reason}). "
                f"Fix: pass --data FOLDER holding the four IDX files (Debian: apt install "
                f"dataset-fashion-mnist, then --data /usr/share/datasets/fashion-mnist), or --synthetic")
    return "" if find_idx_files(root) else f"the download into {root} left no IDX files there"


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (the MNIST format: magic, big-endian sizes, uint8 data) as a uint8 tensor."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            raw = f.read()
        ndim = raw[3]
        dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    except (OSError, EOFError, IndexError, struct.error) as e:
        raise ValueError(f"{path} is unreadable or truncated ({e}); delete it and download it again")
    header = 4 + 4 * ndim
    if len(raw) != header + torch.Size(dims).numel():
        raise ValueError(f"{path} is truncated ({len(raw)} bytes, the header promises "
                         f"{header + torch.Size(dims).numel()}); delete it and download it again")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=header).view(*dims)


def load_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    """Train and test sets as in-memory tensors scaled to [0, 1], as ToTensor() gives them."""
    if args.synthetic:  # random FashionMNIST-shaped data with the real set sizes
        g = torch.Generator().manual_seed(args.seed)
        images = {n: torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
                  for n in (60000, 10000)}
        labels = {n: torch.randint(0, 10, (n,), generator=g) for n in (60000, 10000)}
        return tuple(TensorDataset(images[n].float() / 255, labels[n]) for n in (60000, 10000))
    files = find_idx_files(Path(args.data))
    sets = []
    for split in ("train", "test"):
        images = read_idx(files[f"{split}_images"]).unsqueeze(1).float() / 255
        labels = read_idx(files[f"{split}_labels"]).long()
        sets.append(TensorDataset(images, labels))
    return sets[0], sets[1]


def prepare_dataloader(dataset: Dataset, batch_size: int, seed: int, pin_memory: bool) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=pin_memory,  # fixed: the tutorial pins always; it only helps when copying to a GPU
        shuffle=False,  # the sampler shuffles
        sampler=DistributedSampler(dataset, seed=seed),
    )


def train(model: nn.Module, train_loader: DataLoader, loss_function: nn.Module,
          optimizer: torch.optim.Optimizer, device: torch.device, args: argparse.Namespace) -> dict:
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    steps, average_loss = 0, float("nan")
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # fixed: without it every epoch sees the same order
        model.train()
        start = time.perf_counter()
        running = torch.zeros(2, device=device)  # [sum of batch losses, batches]
        for i, (images, labels) in enumerate(train_loader):
            if args.max_steps and i >= args.max_steps:
                break
            # fixed: no torch.div(images, 255.) here; the data is already in [0, 1]
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_function(model(images), labels)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            steps += 1
        # fixed: the tutorial prints rank 0's share; average the loss over every rank's batches
        dist.all_reduce(running)
        average_loss = (running[0] / running[1]).item()
        seconds = time.perf_counter() - start
        images_per_sec = running[1].item() * args.batch_size / seconds
        print0(f"epoch {epoch + 1}/{args.epochs} | loss {average_loss:.4f} | "
               f"{images_per_sec:.0f} img/s | {seconds:.1f} s{args.tag}")
    return {"epochs_run": args.epochs, "steps": steps, "final_loss": average_loss}


@torch.no_grad()
def test(model: nn.Module, test_set: Dataset, device: torch.device, batch_size: int) -> tuple[int, int]:
    """Correct predictions and samples over the whole test set, each sample counted once.

    DistributedSampler pads the last share by repeating samples so all ranks get the same
    count; that is right for training and wrong for a score. Each rank here takes every
    world_size-th sample, shares may differ by one, and no collective runs inside the loop."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    share = Subset(test_set, range(rank, len(test_set), world_size))
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)  # [correct, seen]
    for images, labels in DataLoader(share, batch_size=batch_size):
        images, labels = images.to(device), labels.to(device)
        counts[0] += (model(images).argmax(1) == labels).sum()
        counts[1] += len(labels)
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1])


def main(local_rank: int, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    device = ddp_setup(local_rank, args.nprocs, args.cpu, args.timeout)
    try:
        world_size = dist.get_world_size()
        if not args.synthetic and args.torchrun:
            # Under torchrun nothing ran before the workers: one process per node gets the data,
            # the others wait for its verdict instead of all downloading at once.
            problem = prepare_data(Path(args.data)) if local_rank == 0 else ""
            if problem:  # say it now: torchrun stops this process once another rank has exited
                print(f"error: {problem}", file=sys.stderr, flush=True)
            ok = torch.tensor([0 if problem else 1], device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not ok.item():
                sys.exit(1)
        train_set, test_set = load_datasets(args)

        torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
        my_net = SeqNet(784, 200, 200, 10).to(device)
        if args.load_model:
            my_net.load_state_dict(load_weights(args.load_model, device))
        optimizer = torch.optim.Adam(my_net.parameters(), lr=args.lr)
        loss_function = nn.CrossEntropyLoss()
        train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, device.type == "cuda")

        results = {"epochs_run": 0, "steps": 0, "final_loss": None}
        if not args.eval_only:
            results = train(my_net, train_loader, loss_function, optimizer, device, args)
        correct, seen = test(my_net, test_set, device, args.batch_size)
        print0(f"done | test_accuracy {correct / seen:.4f} ({seen} images) | world_size {world_size} | "
               f"backend {dist.get_backend()} | {time.perf_counter() - started:.1f} s{args.tag}")
        if dist.get_rank() == 0:
            if args.save_model:
                save_weights(my_net, args.save_model)
            if args.metrics_out:
                write_json(args.metrics_out, {
                    "script": "ddp_fashionmnist.py", "world_size": world_size,
                    "backend": dist.get_backend(), "device": device.type,
                    "data": "synthetic" if args.synthetic else str(args.data), **results,
                    "test_accuracy": correct / seen, "test_correct": correct, "test_samples": seen,
                    "seconds": time.perf_counter() - started,
                })
    finally:
        cleanup()


def save_weights(model: nn.Module, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves half a file under the real name


def load_weights(path: str, device: torch.device) -> dict:
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        SeqNet(784, 200, 200, 10).load_state_dict(state)  # names and shapes fit?
        return state
    except Exception as e:
        sys.exit(f"error: cannot load --load-model {path} ({type(e).__name__}); pass a file written by --save-model")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nprocs", type=int, default=default_nprocs(),
                   help="processes to spawn (ignored under torchrun); default: GPUs, or 2 on CPU")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even where GPUs exist")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=100, help="per process")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after N steps (0: no limit)")
    p.add_argument("--data", default="data", help="torchvision root, or a folder with the four IDX files")
    p.add_argument("--synthetic", action="store_true", help="random FashionMNIST-shaped data (smoke runs)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait")
    p.add_argument("--save-model", help="rank 0 saves the trained weights here")
    p.add_argument("--load-model", help="start from weights saved by --save-model")
    p.add_argument("--eval-only", action="store_true", help="skip training, only test")
    p.add_argument("--metrics-out", help="rank 0 writes the results here as JSON")
    args = p.parse_args()
    args.tag = " | synthetic data" if args.synthetic else ""
    args.torchrun = "RANK" in os.environ  # launched by torchrun (or another env:// launcher)
    return args


def check_args(args: argparse.Namespace) -> None:
    for name in ("epochs", "batch_size", "lr"):
        if getattr(args, name) <= 0:
            sys.exit(f"error: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.max_steps < 0:
        sys.exit(f"error: --max-steps must be 0 (no limit) or positive, got {args.max_steps}")
    if args.load_model:
        load_weights(args.load_model, torch.device("cpu"))  # a bad file is one error before spawning
    check_launch(args)


if __name__ == "__main__":
    args = parse_args()
    check_args(args)
    if not args.synthetic and not args.torchrun:
        problem = prepare_data(Path(args.data))  # once, before any process is spawned
        if problem:
            sys.exit(f"error: {problem}")
    launch(main, args)
