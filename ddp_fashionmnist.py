"""The "Data-Parallel Training" tutorial (SeqNet on FashionMNIST, mp.spawn), fixed.

    python ddp_fashionmnist.py    # one process per GPU, or 2 on CPU; data in ./data
    torchrun --standalone --nproc-per-node=2 ddp_fashionmnist.py --cpu --synthetic

Rank 0 prints `start | ...`, `epoch 10/10 | loss 0.4578 | 28126 img/s` and
`done | test_accuracy ...`. --synthetic trains on random data, with no download.
"""

# fixed: the tutorial also imports mlflow, which it never uses
import argparse
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
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    Subset,
    TensorDataset,
)
from torchvision import datasets


def ddp_setup(local_rank, args):
    """Join the process group. local_rank is this process's number on its machine (its
    GPU); dist.get_rank() is its number in the whole group. On one machine they are
    the same; on several, torchrun numbers the ranks across machines."""
    # fixed: the tutorial hard-codes NCCL, which needs GPUs; gloo runs on a CPU
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        # before the first collective (a call that every rank makes: all_reduce,
        # broadcast, barrier), or every rank works on cuda:0
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    # --timeout: a collective that waits longer than this for another rank fails, so
    # a lost rank ends the job instead of hanging it
    timeout = timedelta(seconds=args.timeout)
    # device_id (optional, GPUs only): NCCL sets up on this rank's GPU now, not at
    # the first collective, so an NCCL or GPU error shows here, at the start
    kwargs = dict(timeout=timeout, device_id=device if cuda else None)
    # Started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set, and
    # init_process_group reads them (its default, env://). A variable set but empty
    # (RANK=$(cmd) where cmd failed) counts as unset.
    if not os.environ.get("RANK"):
        # fixed: the tutorial's ranks meet on a hard-coded MASTER_PORT that another
        # run can take. launch(), below, spawned us: it holds a free port (now in
        # MASTER_PORT) with a TCPStore, the key-value server in which ranks meet.
        # (env:// would have rank 0 open that server, on a port now taken.) Each
        # rank joins launch()'s store as a client and hands it to init_process_group.
        port = int(os.environ["MASTER_PORT"])
        store = dist.TCPStore("127.0.0.1", port, timeout=timeout)
        kwargs.update(store=store, rank=local_rank, world_size=args.nprocs)
    try:
        dist.init_process_group(backend, **kwargs)
    except ValueError as e:
        # RANK set without the other three (a leftover `export RANK=0`, say): env://
        # names the one it lacks, and we add what RANK means
        sys.exit(
            f"error: {e}; RANK is set, so this process joins a group started"
            " elsewhere: set WORLD_SIZE, MASTER_ADDR and MASTER_PORT too, or unset RANK"
        )
    # SIGTERM (how launch() and torchrun stop the ranks) now raises KeyboardInterrupt,
    # as Ctrl-C does, so that clean-up in `finally:` blocks runs before the rank ends
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return device


def print0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def load_datasets(args):
    if args.synthetic:
        # random data of FashionMNIST's shapes, the same on every rank (seed 0)
        images = torch.rand(70000, 1, 28, 28)
        labels = torch.randint(10, (70000,))
        train_set = TensorDataset(images[:60000], labels[:60000])
        return train_set, TensorDataset(images[60000:], labels[60000:])
    # the training and the test split, as torchvision reads them from --data
    sets = [
        datasets.FashionMNIST(args.data, train=is_train) for is_train in (True, False)
    ]
    # Each as one TensorDataset of whole tensors, the images scaled once to [0, 1].
    # fixed: the tutorial's ToTensor() and then torch.div(images, 255.) scaled twice.
    return tuple(TensorDataset(s.data.unsqueeze(1) / 255, s.targets) for s in sets)


def prepare_dataloader(dataset, batch_size, device):
    # each rank its own share, shuffled
    sampler = DistributedSampler(dataset)
    # fixed: the tutorial always pins memory, which only helps copies to a GPU
    return DataLoader(
        dataset, batch_size, sampler=sampler, pin_memory=device.type == "cuda"
    )


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
    """The tutorial's loop. Returns the last epoch's mean loss over every image."""
    # From here on, backward() averages every rank's gradients. The wrapper shares
    # the model's weights: the caller's model is trained too. On a GPU, DDP uses the
    # device set in ddp_setup (the tutorial's device_ids).
    model = DDP(model)
    for epoch in range(1, args.epochs + 1):
        # fixed: without set_epoch every epoch has one order
        train_loader.sampler.set_epoch(epoch)
        model.train()
        # summed on the device: .item() at every step would wait for it
        running_loss = torch.zeros((), device=device)
        began = time.monotonic()
        for images, labels in train_loader:
            # fixed: no second / 255
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = loss_function(model(images), labels)
            loss.backward()
            optimizer.step()
            # weighted by its images, so that a short last batch counts for less
            running_loss += loss.detach() * len(labels)
        # fixed: the tutorial prints rank 0's loss alone; this is the mean over every
        # rank's images (DistributedSampler gives each rank len(sampler) of them)
        dist.all_reduce(running_loss)
        images_seen = len(train_loader.sampler) * dist.get_world_size()
        average_loss = running_loss.item() / images_seen
        # len(train_loader.dataset): the whole training set, every rank's share
        rate = len(train_loader.dataset) / (time.monotonic() - began)
        print0(
            f"epoch {epoch}/{args.epochs} | loss {average_loss:.4f} | {rate:.0f} img/s"
        )
    return average_loss


@torch.no_grad()
def test(model, test_set, device, batch_size):
    """Accuracy over the test set, each image once: a DistributedSampler would add
    repeats to even out the shares."""
    # every world_size-th image, from this rank's number on
    share = Subset(
        test_set, range(dist.get_rank(), len(test_set), dist.get_world_size())
    )
    # [correct, seen]
    counts = torch.zeros(2, dtype=torch.long, device=device)
    model.eval()
    for images, labels in DataLoader(share, batch_size=batch_size):
        predicted = model(images.to(device)).argmax(1)
        counts[0] += (predicted == labels.to(device)).sum()
        counts[1] += len(labels)
    # the whole test set's, not rank 0's share alone
    dist.all_reduce(counts)
    correct, seen = counts.tolist()
    return dict(test_accuracy=correct / seen, test_correct=correct, test_samples=seen)


def main(local_rank, args):
    device = ddp_setup(local_rank, args)
    try:
        # fixed: every rank downloaded at once. Under torchrun, local rank 0 of each
        # machine downloads before it joins (below, under __main__); the others wait
        # here until all have joined, so that none reads a half-written file. (The
        # barrier makes that wait explicit: init_process_group does not promise it.)
        dist.barrier()
        # seed 0: the same synthetic data on every rank, and the same initial weights in
        # every run (DDP copies rank 0's to the other ranks)
        torch.manual_seed(0)
        train_set, test_set = load_datasets(args)
        my_net = SeqNet(784, 200, 200, 10).to(device)
        optimizer = torch.optim.Adam(my_net.parameters(), lr=args.lr)
        loss_function = nn.CrossEntropyLoss()
        train_loader = prepare_dataloader(train_set, args.batch_size, device)
        results = dict(
            script=Path(__file__).name,
            world_size=dist.get_world_size(),
            device=device.type,
            backend=dist.get_backend(),
            data="synthetic" if args.synthetic else args.data,
        )
        print0("start |", " | ".join(f"{k} {v}" for k, v in results.items()))
        results["final_loss"] = train(
            my_net, train_loader, loss_function, optimizer, device, args
        )
        # my_net holds the trained weights: the DDP wrapper in train shares them
        results.update(test(my_net, test_set, device, args.batch_size))
        print0(
            f"done | test_accuracy {results['test_accuracy']:.4f}"
            f" ({results['test_samples']} images)"
        )
        if dist.get_rank() == 0 and args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()
    except RuntimeError as e:
        # A collective whose peer died raises this (the three phrases are gloo's and
        # NCCL's for a lost connection). This rank waits 3 s before it fails, so that
        # mp.spawn sees the peer's death first and reports that rank, the cause.
        if any(w in str(e) for w in ("by peer", "Broken pipe", "remote process")):
            time.sleep(3)
        raise


# --- launching and checks (the same in the three DDP scripts of this repository) ---
# launch() runs the per-process function once in each rank. Under torchrun this
# process is one rank already; otherwise it spawns --nprocs ranks here, as the
# tutorial's mp.spawn does.
# If you copy this section into a script of your own, you may drop the refusals,
# the OMP_NUM_THREADS setting and the --metrics-out check. Keep the store (it holds
# MASTER_PORT while the ranks meet in it) and the two signal lines (Ctrl-C and
# SIGTERM then stop every rank).
def launch(main, args):
    # set by torchrun; an empty one counts as unset, as in ddp_setup
    rank = os.environ.get("RANK")
    try:
        # rank 0 writes --metrics-out at the end: if it cannot, say so now
        if args.metrics_out and (not rank or rank == "0"):
            Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
            open(args.metrics_out, "a").close()
        if rank:
            # Started by torchrun (or a pod's RANK): this process is one rank.
            # record() puts an error of this rank into torchrun's summary.
            local_rank = int(os.environ.get("LOCAL_RANK") or 0)
            return record(main)(local_rank, args)
        # srun -n N sets this: N copies of this launcher, each spawning its own world
        if int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1:
            sys.exit(
                "error: srun -n N starts N separate jobs; run torchrun once per node"
            )
        if 0 < torch.cuda.device_count() < args.nprocs and not args.cpu:
            sys.exit(
                f"error: --nprocs {args.nprocs}, but fewer GPUs here;"
                " use fewer, or --cpu"
            )
        # fixed: each rank starts a thread per core, and the ranks fight over the
        # cores; each gets its share (torchrun sets 1)
        threads = max(1, os.cpu_count() // args.nprocs)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        # fixed: not a hard-coded 12355: MASTER_PORT if set, else port 0, which
        # asks the system for a free one. The store (is_master: the server) holds the
        # port until the end, so a second run on it is refused at once. The ranks,
        # all on this machine, dial it at 127.0.0.1.
        port = int(os.environ.get("MASTER_PORT") or 0)
        timeout = timedelta(seconds=args.timeout)
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout)
        except dist.DistNetworkError as e:
            # taken, by another run say
            sys.exit(
                f"error: {e}; unset MASTER_PORT for a free port, or choose another"
            )
        os.environ["MASTER_PORT"] = str(store.port)
        # Ctrl-C (SIGINT) raises KeyboardInterrupt here and in each rank. A shell
        # script's `cmd &` starts cmd with SIGINT ignored, and child processes inherit
        # an ignored signal, but not a handler: with this one, the ranks start with
        # Python's usual Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # SIGTERM (kill, a job scheduler): terminate_ranks(), below, passes it on
        signal.signal(signal.SIGTERM, terminate_ranks)
        # when one rank fails, mp.spawn sends SIGTERM to the others and raises
        mp.spawn(main, (args,), nprocs=args.nprocs)
    except mp.ProcessExitedException as e:
        # a rank that exited with a code (> 0) has said why; one that a signal killed
        # (exit_code < 0) has not
        if e.exit_code > 0:
            sys.exit(e.exit_code)
        sys.exit(f"error: {e}")
    except (mp.ProcessRaisedException, OSError, dist.DistError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        # Ctrl-C, which every rank got too, or SIGTERM: 130, the shell's code for a
        # Ctrl-C (128 + SIGINT's number, 2)
        sys.exit(130)


def terminate_ranks(*_):
    """SIGTERM to the launcher: passed on to each rank; then we end as on Ctrl-C."""
    # Ignore further SIGTERMs to this launcher: each would run this function again,
    # and send every rank another SIGTERM, which would interrupt its clean-up
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for process in mp.active_children():
        process.terminate()
    raise KeyboardInterrupt


def positive(text):
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(
            f"expected a whole number above 0, got {text!r}"
        )
    return int(text)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpus = torch.cuda.device_count()
    p.add_argument("--nprocs", type=positive, default=gpus or 2, help="ranks")
    p.add_argument(
        "--cpu", action="store_true", help="gloo on CPU even where GPUs exist"
    )
    p.add_argument(
        "--timeout", type=positive, default=300, help="seconds a rank waits for another"
    )
    p.add_argument("--metrics-out", help="rank 0 writes the results here as JSON")
    p.add_argument("--epochs", type=positive, default=10)
    p.add_argument("--batch-size", type=positive, default=100, help="per process")
    p.add_argument("--lr", type=float, default=0.01, help="Adam's")
    # read only by load_datasets and the download below: a copy with data of its own
    # drops these
    p.add_argument("--data", default="data", help="torchvision's FashionMNIST root")
    p.add_argument(
        "--synthetic", action="store_true", help="random data of the same shape"
    )
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    # fixed: the tutorial downloads in every rank at once. One process a machine reads
    # what is there and downloads what is not: where RANK is unset, this one, which
    # spawns the ranks (whatever LOCAL_RANK a shell left behind); under torchrun, the
    # one with LOCAL_RANK 0. The ranks wait for it in a barrier.
    spawn = not os.environ.get("RANK")
    if not args.synthetic and (spawn or os.environ.get("LOCAL_RANK", "0") == "0"):
        try:
            # reads what is there, downloads what is not
            for is_train in (True, False):
                datasets.FashionMNIST(args.data, train=is_train, download=True)
        except Exception as e:
            # no network, a damaged file
            why = " ".join(str(e).split())
            sys.exit(f"error: FashionMNIST in {args.data}: {why}")
    launch(main, args)
