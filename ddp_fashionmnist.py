"""The "Data-Parallel Training" tutorial (SeqNet on FashionMNIST, mp.spawn), its bugs fixed.
    python ddp_fashionmnist.py      # one process per GPU, or 2 on CPU; downloads into ./data once
    torchrun --standalone --nproc-per-node=2 ddp_fashionmnist.py --cpu --synthetic  # random data
Rank 0 prints `start | ...`, `epoch 10/10 | loss 0.4578 | 28126 img/s`, `done | test_accuracy`."""

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch  # fixed: the tutorial also imports mlflow, which it never uses
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset
from torchvision import datasets


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


def load_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    if args.synthetic:  # random data of FashionMNIST's shapes, the same on every rank (seed 0)
        x, y = torch.rand(70000, 1, 28, 28), torch.randint(10, (70000,))
        return TensorDataset(x[:60000], y[:60000]), TensorDataset(x[60000:], y[60000:])
    sets = [datasets.FashionMNIST(args.data, train=split) for split in (True, False)]
    # fixed: the tutorial's ToTensor() and then torch.div(images, 255.) scaled them twice
    return tuple(TensorDataset(s.data.unsqueeze(1) / 255, s.targets) for s in sets)


def prepare_dataloader(dataset: Dataset, batch_size: int, device: torch.device) -> DataLoader:
    sampler = DistributedSampler(dataset)  # each rank its own share, shuffled
    # fixed: the tutorial always pins memory, which only helps copies to a GPU
    return DataLoader(dataset, batch_size, sampler=sampler, pin_memory=device.type == "cuda")


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
        x = torch.log_softmax(x, dim=1)  # the tutorial's odd activation, kept to match it
        return self.lin3(x)


def train(model, train_loader, loss_function, optimizer, device, args) -> float:
    """The tutorial's loop; returns the last epoch's mean loss over every rank's steps."""
    model = DDP(model)  # from here on, backward() averages every rank's gradients
    for epoch in range(1, args.epochs + 1):
        train_loader.sampler.set_epoch(epoch)  # fixed: without it every epoch has one order
        model.train()
        running_loss, began = torch.zeros((), device=device), time.monotonic()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)  # fixed: no second / 255
            optimizer.zero_grad()
            loss = loss_function(model(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.detach()  # no .item(): it would wait for the device each step
        dist.all_reduce(running_loss)  # fixed: every rank's steps, not rank 0's share alone
        average_loss = running_loss.item() / len(train_loader) / dist.get_world_size()
        rate = len(train_loader.dataset) / (time.monotonic() - began)  # every rank's images
        print0(f"epoch {epoch}/{args.epochs} | loss {average_loss:.4f} | {rate:.0f} img/s")
    return average_loss


@torch.no_grad()
def test(model: nn.Module, test_set: Dataset, device: torch.device, batch_size: int) -> dict:
    """Accuracy over the test set, each image once: a DistributedSampler would add repeats."""
    share = Subset(test_set, range(dist.get_rank(), len(test_set), dist.get_world_size()))
    counts = torch.zeros(2, dtype=torch.long, device=device)  # [correct, seen]
    model.eval()
    for images, labels in DataLoader(share, batch_size=batch_size):
        counts[0] += (model(images.to(device)).argmax(1) == labels.to(device)).sum()
        counts[1] += len(labels)
    dist.all_reduce(counts)  # the whole test set's, not rank 0's share alone
    correct, seen = counts.tolist()
    return dict(test_accuracy=correct / seen, test_correct=correct, test_samples=seen)


def main(local_rank: int, args: argparse.Namespace) -> None:
    device = ddp_setup(local_rank, args)
    try:
        dist.barrier()  # fixed: one process per machine downloaded the data (below) first
        torch.manual_seed(0)  # the same initial weights (and synthetic data) on every rank
        train_set, test_set = load_datasets(args)
        my_net = SeqNet(784, 200, 200, 10).to(device)
        optimizer = torch.optim.Adam(my_net.parameters(), lr=args.lr)
        loss_function = nn.CrossEntropyLoss()
        train_loader = prepare_dataloader(train_set, args.batch_size, device)
        m = dict(script=Path(__file__).name, world_size=dist.get_world_size(), device=device.type)
        m.update(backend=dist.get_backend(), data="synthetic" if args.synthetic else args.data)
        print0("start |", " | ".join(f"{k} {v}" for k, v in m.items()))
        m["final_loss"] = train(my_net, train_loader, loss_function, optimizer, device, args)
        m.update(test(my_net, test_set, device, args.batch_size))
        print0(f"done | test_accuracy {m['test_accuracy']:.4f} ({m['test_samples']} images)")
        if dist.get_rank() == 0 and args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps(m, indent=1))
        dist.destroy_process_group()
    except RuntimeError as e:  # a lost peer (gloo's, NCCL's words): let its own report come first
        time.sleep(3 * any(w in str(e) for w in ("by peer", "Broken pipe", "remote process")))
        raise


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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=positive, default=torch.cuda.device_count() or 2, help="ranks")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where GPUs exist")
    p.add_argument("--timeout", type=positive, default=300, help="seconds a rank waits for another")
    p.add_argument("--metrics-out", help="rank 0 writes the results here as JSON")
    p.add_argument("--epochs", type=positive, default=10)
    p.add_argument("--batch-size", type=positive, default=100, help="per process")
    p.add_argument("--lr", type=float, default=0.01, help="Adam's")
    p.add_argument("--data", default="data", help="torchvision's FashionMNIST root")
    p.add_argument("--synthetic", action="store_true", help="random data of the same shape")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    if not args.synthetic and os.environ.get("LOCAL_RANK", "0") == "0":  # fixed: once a machine
        try:  # reads what is there, downloads what is not (the tutorial: every rank, at once)
            for split in (True, False):  # the files only: the ranks make the tensors
                datasets.FashionMNIST(args.data, train=split, download=True)
        except Exception as e:  # no network, a damaged file
            sys.exit(f"error: FashionMNIST in {args.data}: {' '.join(str(e).split())}")
    launch(main, args)
