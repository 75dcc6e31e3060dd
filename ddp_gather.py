"""Gather per-rank objects and tensors ("A Comprehensive Tutorial to Pytorch DDP", section 6).
    python ddp_gather.py                       # one process per GPU, or 2 CPU processes
    torchrun --standalone --nproc-per-node=3 ddp_gather.py --cpu   # gloo on CPU, 3 processes
Rank 0 prints the gathered dicts and tensors, then `done | gathered 2 objects | backend gloo`."""

import argparse
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record


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
        if args.metrics_out:  # tensors as lists
            m = dict(script=Path(__file__).name, world_size=world_size, gathered=outputs)
            Path(args.metrics_out).write_text(json.dumps(m, default=torch.Tensor.tolist))
    dist.destroy_process_group()


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
    return p.parse_args()


if __name__ == "__main__":
    launch(main, parse_args())
