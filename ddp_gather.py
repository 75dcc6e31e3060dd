#!/usr/bin/env python3
"""Gather per-rank Python objects and tensors with torch.distributed.

Follows "A Comprehensive Tutorial to Pytorch DistributedDataParallel", section 6: every rank
builds a dict, all_gather_object hands every rank the list of them in rank order, and
all_gather does the same for tensors.

    python ddp_gather.py                       # one process per GPU, or 2 CPU processes
    python ddp_gather.py --cpu --nprocs 3      # gloo on CPU, 3 processes
    torchrun --standalone --nproc-per-node=2 ddp_gather.py --cpu

Rank 0 prints a start line (`start | 2 processes | gloo on CPU | one dict and one tensor per
rank`), the gathered list and a final line:
    gathered 2 objects | world_size 2 | backend gloo
"""
import argparse
import ctypes
import json
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta

if __name__ == "__main__":  # Ctrl-C while the slow imports below run: exit 130, no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(130))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record


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


def main(local_rank: int, args: argparse.Namespace) -> None:
    device = ddp_setup(local_rank, args)
    try:
        print0(f"start | {where(device)} | one dict and one tensor per rank")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        tensor = torch.ones(3, device=device) + rank  # set_device came first: see ddp_setup
        data = {
            "tensor": tensor.cpu(),  # a GPU one: every rank would unpickle it on the sender's GPU
            "list": [x + rank for x in [1, 2, 3]],  # fixed: the tutorial's [1,2,3] + rank fails
            "dict": {"rank": rank},
        }
        outputs = [None] * world_size  # room for one object per rank
        dist.all_gather_object(outputs, data)
        # all_gather_object takes any picklable object, at the cost of pickling and a size
        # exchange, and unpickles what the others send (code can run: trusted peers only).
        # all_gather moves same-shaped tensors with no trip through Python: use it for anything
        # large or per step.
        tensors = [torch.empty(3, device=device) for _ in range(world_size)]
        dist.all_gather(tensors, tensor)
        print0(outputs)
        print0(f"all_gather: {[t.tolist() for t in tensors]}")
        print0(f"gathered {len(outputs)} objects | world_size {world_size} | "
               f"backend {dist.get_backend()}")
        if rank == 0 and args.metrics_out:
            with open(args.metrics_out, "w") as f:  # tensors as lists
                json.dump({"script": "ddp_gather.py", "world_size": world_size,
                           "backend": dist.get_backend(), "device": device.type,
                           "gathered": outputs, "gathered_tensors": tensors},
                          f, indent=1, default=torch.Tensor.tolist)
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


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    check_args(args, positive=())
    launch(main, args)
