"""Gather per-rank objects and tensors ("A Comprehensive Tutorial to Pytorch DDP", section 6).

    python ddp_gather.py                       # one process per GPU, or 2 CPU processes
    torchrun --standalone --nproc-per-node=3 ddp_gather.py --cpu   # gloo on CPU, 3 processes

Rank 0 prints the gathered dicts and tensors, then `done | gathered 2 objects | backend gloo`."""

import argparse
import json
import os
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record


def ddp_setup(local_rank: int, args: argparse.Namespace) -> torch.device:
    os.environ.setdefault("RANK", str(local_rank))  # spawned by launch(): rank = local rank
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before any collective, or every rank uses cuda:0
    # fixed: NCCL needs a GPU per process, gloo runs anywhere; a finite timeout ends a hung job
    backend, timeout = ("nccl" if cuda else "gloo"), timedelta(seconds=args.timeout)
    dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop ends a save as Ctrl-C does
    return device


def main(local_rank: int, args: argparse.Namespace) -> None:
    device = ddp_setup(local_rank, args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tensor = torch.ones(3, device=device) + rank
    # fixed: the tutorial's [1, 2, 3] + rank fails; a GPU tensor would unpickle onto GPU 0
    data = {"tensor": tensor.cpu(), "list": [x + rank for x in [1, 2, 3]], "dict": {"rank": rank}}
    outputs = [None] * world_size  # one place per rank, filled in rank order
    # all_gather_object: any picklable object, but unpickling runs the others' code (trusted
    # peers only). all_gather: same-shaped tensors without Python: for large or per-step data.
    dist.all_gather_object(outputs, data)
    tensors = [torch.empty(3, device=device) for _ in range(world_size)]
    dist.all_gather(tensors, tensor)
    if rank == 0:
        print(outputs, f"all_gather: {[t.tolist() for t in tensors]}", sep="\n")
        print(f"done | gathered {len(outputs)} objects | backend {dist.get_backend()}")
        if args.metrics_out:
            metrics = dict(script=Path(__file__).name, world_size=world_size, gathered=outputs)
            with open(args.metrics_out, "w") as f:
                json.dump(metrics, f, default=torch.Tensor.tolist)  # tensors as lists
    dist.destroy_process_group()


# --- launching and checks (the same in every DDP script of this collection) ---
def launch(main, args: argparse.Namespace) -> None:  # torchrun: we are one rank; else spawn
    try:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one process a node: the others wait for it
            Path(args.metrics_out or ".").parent.mkdir(parents=True, exist_ok=True)  # or its error
        if "RANK" in os.environ:  # torchrun set RANK, LOCAL_RANK, WORLD_SIZE and MASTER_*
            return record(main)(int(os.environ["LOCAL_RANK"]), args)  # in torchrun's summary
        if int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1:  # srun -n 2 python script.py
            sys.exit("error: srun -n N starts N separate jobs; run torchrun once per node")
        if 0 < torch.cuda.device_count() < args.nprocs and not args.cpu:
            sys.exit(f"error: --nprocs {args.nprocs}, but fewer GPUs here; use fewer, or --cpu")
        os.environ["WORLD_SIZE"] = str(args.nprocs)  # the ranks inherit the environment
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() // args.nprocs or 1))  # cores
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:  # fixed: not the tutorials' 12355 (it collides): a free port
            s.bind((os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", 0))))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        mp.spawn(main, (args,), nprocs=args.nprocs)  # one rank fails: SIGTERM to the others
    except (mp.ProcessExitedException, mp.ProcessRaisedException, OSError) as e:
        # a rank failed and said why, or we do; a MASTER_PORT you set is taken; no --metrics-out dir
        sys.exit(e.exit_code if getattr(e, "exit_code", 0) > 0 else f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C, or a stop (SIGTERM): every rank got it too
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
    return p.parse_args()


if __name__ == "__main__":
    launch(main, parse_args())
