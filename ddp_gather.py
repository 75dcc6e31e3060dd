#!/usr/bin/env python3
"""Gather per-rank Python objects and tensors with torch.distributed.

Follows "A Comprehensive Tutorial to Pytorch DistributedDataParallel", section 6
(all_gather_object), and shows the tensor collective (all_gather) next to it.

    python ddp_gather.py                          # one process per GPU, or 2 CPU processes
    python ddp_gather.py --cpu --nprocs 3         # gloo on CPU, 3 processes
    torchrun --standalone --nproc-per-node=2 ddp_gather.py --cpu

Rank 0 prints the gathered list in rank order and a final line:
    gathered 2 objects | world_size 2 | backend gloo
"""
import argparse
import json
import os
import pickle
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def json_safe(obj):
    """Tensors become lists so the gathered objects can go into the metrics JSON."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def main(local_rank: int, args: argparse.Namespace) -> None:
    device = ddp_setup(local_rank, args.nprocs, args.cpu, args.timeout)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # The tutorial: tensors in the object live on this rank's device (set_device came first).
        data = {
            "tensor": torch.ones(3, device=device) + rank,
            "list": [x + rank for x in [1, 2, 3]],  # fixed: the tutorial's [1,2,3] + rank is a TypeError
            "dict": {"rank": rank},
        }
        # When to use which: all_gather_object takes any picklable object of any size, at the cost of
        # pickling and a size exchange; all_gather moves same-shaped tensors with no copy to Python,
        # so use it for anything large or per-step. all_gather_object unpickles what other ranks
        # send (code can run): only use it between processes you trust.
        outputs = [None] * world_size
        dist.all_gather_object(outputs, data)

        tensors = [torch.empty(3, device=device) for _ in range(world_size)]  # preallocated
        dist.all_gather(tensors, data["tensor"])

        # Every rank received the full list; check each one got the same thing, in rank order.
        mine = json.dumps(json_safe(outputs))
        views = [None] * world_size
        dist.all_gather_object(views, mine)
        in_order = all(o["dict"]["rank"] == i for i, o in enumerate(outputs))

        print0(outputs)
        print0(f"all_gather: {[t.tolist() for t in tensors]}")
        print0(f"gathered {len(outputs)} objects | world_size {world_size} | backend {dist.get_backend()}")
        if rank == 0 and args.metrics_out:
            write_json(args.metrics_out, {
                "script": "ddp_gather.py",
                "world_size": world_size,
                "backend": dist.get_backend(),
                "device": device.type,
                "gathered": json_safe(outputs),
                "gathered_tensors": [t.tolist() for t in tensors],
                "same_on_every_rank": all(v == mine for v in views),
                "in_rank_order": in_order,
            })
    finally:
        cleanup()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nprocs", type=int, default=default_nprocs(),
                   help="processes to spawn (ignored under torchrun); default: GPUs, or 2 on CPU")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even where GPUs exist")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait")
    p.add_argument("--metrics-out", help="rank 0 writes the results here as JSON")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    check_launch(args)
    launch(main, args)
