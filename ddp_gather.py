"""Gather objects and tensors from every rank (Comprehensive DDP Tutorial, sec. 6).

    python ddp_gather.py          # one process per GPU, or 2 on a CPU
    torchrun --standalone --nproc-per-node=3 ddp_gather.py --cpu

Rank 0 prints the gathered objects, the tensors and `done | gathered N objects | ...`.
"""

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
from torch.distributed.elastic.multiprocessing.errors import record


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


def main(local_rank, args):
    device = ddp_setup(local_rank, args)
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    tensor = torch.ones(3, device=device) + rank
    data = {
        # fixed: a CPU copy. A CUDA tensor is unpickled onto the GPU it came from,
        # so rank 0 would hold tensors on cuda:1, cuda:2, ...
        "tensor": tensor.cpu(),
        # fixed: the tutorial's [1, 2, 3] + rank is a TypeError
        "list": [x + rank for x in [1, 2, 3]],
        "dict": {"rank": rank},
    }
    # room for one object from each rank, filled in rank order
    outputs = [None] * world_size
    dist.all_gather_object(outputs, data)
    # tensors of one shape in every rank: all_gather sends them without pickling
    tensors = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(tensors, tensor)
    if rank == 0:
        print(outputs)
        print(f"all_gather: {[t.tolist() for t in tensors]}")
        print(f"done | gathered {world_size} objects | backend {dist.get_backend()}")
    # --metrics-out FILE: the results as JSON, for a program to read
    if rank == 0 and args.metrics_out:
        results = dict(
            script=Path(__file__).name, world_size=world_size, gathered=outputs
        )
        # JSON has no tensors: each is written as its tolist()
        text = json.dumps(results, default=torch.Tensor.tolist)
        Path(args.metrics_out).write_text(text)
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


def parse_args():
    p = argparse.ArgumentParser()
    gpus = torch.cuda.device_count()
    p.add_argument("--nprocs", type=positive, default=gpus or 2)
    p.add_argument("--cpu", action="store_true", help="gloo even with GPUs")
    p.add_argument("--timeout", type=positive, default=300, help="seconds")
    p.add_argument("--metrics-out", type=nonempty, help="rank 0's results, as JSON")
    return p.parse_args()


if __name__ == "__main__":
    launch(main, parse_args())
