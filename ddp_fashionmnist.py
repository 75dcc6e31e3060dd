"""The "Data-Parallel Training" tutorial (SeqNet on FashionMNIST, mp.spawn), fixed.

    python ddp_fashionmnist.py    # one process per GPU, or 2 on a CPU; data in ./data
    torchrun --standalone --nproc-per-node=2 ddp_fashionmnist.py --cpu --synthetic

Rank 0 prints `start | ...`, `epoch 10/10 | loss 0.4578 | 28126 img/s` and
`done | test_accuracy ...`. --synthetic trains on random data, with no download.
"""

# fixed: no mlflow here; the tutorial imports it and never uses it
import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

# Ctrl-C while torch imports (seconds): exit at once, without a traceback;
# launch() and ddp_setup put their own handlers in later
signal.signal(signal.SIGINT, signal.SIG_DFL)
# torchrun's pid for stop_after_launcher, read now: torchrun may die while torch loads
LAUNCHER = os.getppid()

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
from torchvision import datasets


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


def load_datasets(args):
    """The training and the test set, held in memory."""
    if args.synthetic:
        # random data of FashionMNIST's shapes, the same in every rank (main seeds it)
        return [
            TensorDataset(torch.rand(n, 1, 28, 28), torch.randint(10, (n,)))
            for n in (60000, 10000)
        ]
    sets = [
        datasets.FashionMNIST(args.data, train=is_train, download=True)
        for is_train in (True, False)
    ]
    # the raw uint8 images as [N, 1, 28, 28] floats in [0, 1]. fixed: the
    # tutorial's ToTensor() and then / 255 scaled them twice
    return [TensorDataset(s.data.unsqueeze(1) / 255, s.targets) for s in sets]


def prepare_dataloader(dataset, batch_size, device):
    # each rank its own share of the data, shuffled
    sampler = DistributedSampler(dataset)
    # fixed: the tutorial pins memory on a CPU too, where it only warns
    pin = device.type == "cuda"
    return DataLoader(dataset, batch_size, sampler=sampler, pin_memory=pin)


class SeqNet(nn.Module):
    def __init__(self, input_size, hidden_size1, hidden_size2, output_size):
        super().__init__()
        self.lin1 = nn.Linear(input_size, hidden_size1)
        self.lin2 = nn.Linear(hidden_size1, hidden_size2)
        self.lin3 = nn.Linear(hidden_size2, output_size)

    def forward(self, x):
        x = torch.flatten(x, 1)
        x = self.lin1(x)
        x = torch.sigmoid(x)
        x = self.lin2(x)
        # the tutorial's odd activation, kept to match it
        x = torch.log_softmax(x, dim=1)
        return self.lin3(x)


def train(model, train_loader, loss_function, optimizer, device, args):
    """The tutorial's loop; returns the last epoch's mean loss per image."""
    # backward() now averages every rank's gradients (DDP uses the model's device)
    model = DDP(model)
    for epoch in range(1, args.epochs + 1):
        # fixed: without set_epoch every epoch has the same order
        train_loader.sampler.set_epoch(epoch)
        model.train()
        # a tensor on the device: all_reduce sums it, and no .item() waits each step
        running_loss = torch.zeros((), device=device)
        began = time.monotonic()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = loss_function(model(images), labels)
            loss.backward()
            optimizer.step()
            # the batch's mean times its size: a short last batch weighs less
            running_loss += loss.detach() * len(labels)
        # fixed: the tutorial prints rank 0's loss alone; this sums every rank's
        dist.all_reduce(running_loss)
        # the images trained on: DistributedSampler gave each rank an equal share
        images_seen = len(train_loader.sampler) * dist.get_world_size()
        average_loss = running_loss.item() / images_seen
        rate = images_seen / (time.monotonic() - began)
        print0(
            f"epoch {epoch}/{args.epochs} | loss {average_loss:.4f} | {rate:.0f} img/s"
        )
    return average_loss


@torch.no_grad()
def test(model, test_set, device, batch_size):
    """Accuracy over the whole test set, each image counted once."""
    # this rank's share, every world_size-th image: unlike a DistributedSampler,
    # it pads nothing, so each image is counted once
    share = Subset(
        test_set, range(dist.get_rank(), len(test_set), dist.get_world_size())
    )
    correct = seen = 0
    model.eval()
    for images, labels in DataLoader(share, batch_size):
        predicted = model(images.to(device)).argmax(1)
        correct += (predicted == labels.to(device)).sum().item()
        seen += len(labels)
    # the whole test set's counts, not this rank's share alone
    counts = torch.tensor([correct, seen], device=device)
    dist.all_reduce(counts)
    correct, seen = counts.tolist()
    return dict(test_accuracy=correct / seen, test_correct=correct, test_samples=seen)


def main(local_rank, args):
    device = ddp_setup(local_rank, args)
    # seed 0: the same synthetic data in every rank, the same weights every run
    torch.manual_seed(0)
    # fixed: every rank downloaded at once. Local rank 0 loads (and downloads)
    # first while the others wait in barrier(); its own barrier() lets them go
    if local_rank > 0:
        dist.barrier()
    train_set, test_set = load_datasets(args)
    if local_rank == 0:
        dist.barrier()
    my_net = SeqNet(784, 200, 200, 10).to(device)
    optimizer = torch.optim.Adam(my_net.parameters(), lr=args.lr)
    loss_function = nn.CrossEntropyLoss()
    train_loader = prepare_dataloader(train_set, args.batch_size, device)
    world_size = dist.get_world_size()
    data_name = "synthetic" if args.synthetic else args.data
    print0(
        f"start | {Path(__file__).name} | world_size {world_size}"
        f" | backend {dist.get_backend()} | device {device}"
        f" | data {data_name} ({len(train_set)} images)"
        f" | batch {args.batch_size} x {world_size} | epochs {args.epochs}"
    )
    # the DDP in train() updates my_net's own weights: test() scores my_net
    loss = train(my_net, train_loader, loss_function, optimizer, device, args)
    results = test(my_net, test_set, device, args.batch_size)
    print0(
        f"done | test_accuracy {results['test_accuracy']:.4f}"
        f" ({results['test_samples']} images)"
    )
    if dist.get_rank() == 0 and args.metrics_out:
        metrics = dict(
            script=Path(__file__).name,
            world_size=world_size,
            backend=dist.get_backend(),
            device=device.type,
            data=data_name,
            final_loss=loss,
            **results,
        )
        Path(args.metrics_out).write_text(json.dumps(metrics, indent=1))
    dist.destroy_process_group()


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
    p.add_argument("--epochs", type=positive, default=10)
    p.add_argument("--batch-size", type=positive, default=100, help="per rank")
    p.add_argument("--lr", type=learning_rate, default=0.01, help="Adam's")
    p.add_argument("--data", type=nonempty, default="data", help="FashionMNIST's root")
    p.add_argument("--synthetic", action="store_true", help="random data")
    return p.parse_args()


if __name__ == "__main__":
    launch(main, parse_args())
