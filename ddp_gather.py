"""Gather objects and tensors from every rank (Comprehensive DDP Tutorial, sec. 6).

    python ddp_gather.py          # one process per GPU, or 2 on a CPU
    torchrun --standalone --nproc-per-node=3 ddp_gather.py --cpu

Rank 0 prints the gathered objects, the tensors and `done | gathered N objects`.
"""

import argparse
import json
import os
import signal
import socket
import sys
from datetime import timedelta

# Until the training starts, Ctrl-C ends the process at once, quietly; later
# it raises KeyboardInterrupt, so that clean-up code runs
signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record


def ddp_setup(local_rank, args):
    """Join the process group; return this rank's device."""
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        # before the first collective, or every rank would use cuda:0
        torch.cuda.set_device(device)
    dist.init_process_group(
        # fixed: the tutorial hard-codes NCCL, which needs GPUs; gloo runs on CPUs
        "nccl" if cuda else "gloo",
        # torchrun gives RANK and WORLD_SIZE; mp.spawn, on one machine, gives
        # local_rank as the rank, and the world size is --nprocs
        rank=int(os.environ.get("RANK") or local_rank),
        world_size=int(os.environ.get("WORLD_SIZE") or args.nprocs),
        # a lost rank ends the job after --timeout instead of hanging it
        timeout=timedelta(seconds=args.timeout),
        # binds the group to this GPU, which barrier() then uses
        device_id=device if cuda else None,
    )
    # the group is up: now Ctrl-C and SIGTERM raise KeyboardInterrupt, so that
    # clean-up code runs (a save in progress removes its .tmp)
    for sig in signal.SIGINT, signal.SIGTERM:
        signal.signal(sig, signal.default_int_handler)
    return device


def main(local_rank, args):
    device = ddp_setup(local_rank, args)
    rank = dist.get_rank()
    tensor = torch.ones(3, device=device) + rank
    data = {
        # a CPU copy: a CUDA tensor would unpickle onto the sender's GPU
        "tensor": tensor.cpu(),
        # fixed: the tutorial's [1, 2, 3] + rank is a TypeError
        "list": [x + rank for x in [1, 2, 3]],
        "dict": {"rank": rank},
    }
    # room for one object from each rank, filled in rank order
    outputs = [None] * dist.get_world_size()
    dist.all_gather_object(outputs, data)
    # tensors of one shape travel without pickle: for large or per-step data
    tensors = [torch.empty_like(tensor) for _ in outputs]
    dist.all_gather(tensors, tensor)
    if rank == 0:
        print(outputs)
        print(f"all_gather: {[t.tolist() for t in tensors]}")
        print(f"done | gathered {len(outputs)} objects | backend {dist.get_backend()}")
    if rank == 0 and args.metrics_out:
        script = os.path.basename(__file__)
        results = dict(script=script, world_size=len(outputs), gathered=outputs)
        # JSON has no tensors: each is written as its tolist()
        text = json.dumps(results, default=torch.Tensor.tolist)
        open(args.metrics_out, "w").write(text)
    dist.destroy_process_group()


# --- launching (copy it whole; a part marked optional may go) ---
def launch(main, args):
    """Run main(local_rank, args) once in each rank."""
    try:
        if os.environ.get("RANK"):
            # torchrun started this process as one rank
            local_rank = int(os.environ.get("LOCAL_RANK") or 0)
            # optional: record adds this rank's traceback to torchrun's report
            return record(main)(local_rank, args)
        # optional, fixed: each rank gets its share of the cores, not all of them
        if not os.environ.get("OMP_NUM_THREADS"):
            threads = max(1, os.cpu_count() // args.nprocs)
            os.environ["OMP_NUM_THREADS"] = str(threads)
        # fixed: a free port that the system picks, not the tutorial's 12355
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        # Ctrl-C reaches every rank; here it ends the wait for them
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # SIGTERM to this launcher alone: terminate_ranks passes it on
        signal.signal(signal.SIGTERM, terminate_ranks)
        ranks = mp.spawn(main, (args,), nprocs=args.nprocs, join=False)
        # when a rank fails, the others get 5 s to end on their own (rank 0 to
        # say why) before torch ends them; join=True would end them at once
        while not ranks.join(grace_period=5):
            pass
    except mp.ProcessExitedException as e:
        # optional: a rank that exited with a code has said why: pass the code
        # on; a rank killed by a signal (a negative code): torch's error names it
        if e.exit_code < 0:
            raise
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        # optional: Ctrl-C or SIGTERM ends quietly, with the shell's code for Ctrl-C
        sys.exit(130)


def terminate_ranks(*_):
    """SIGTERM to this launcher: to each rank too, then as on Ctrl-C."""
    # a second SIGTERM would cut the ranks' clean-up short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for process in mp.active_children():
        process.terminate()
    raise KeyboardInterrupt


# --- end of launching ---
def positive(text):
    if int(text) < 1:
        raise ValueError(text)
    return int(text)


def parse_args():
    p = argparse.ArgumentParser()
    gpus = torch.cuda.device_count()
    p.add_argument("--nprocs", type=positive, default=gpus or 2)
    p.add_argument("--cpu", action="store_true", help="gloo even with GPUs")
    p.add_argument("--timeout", type=positive, default=300, help="seconds")
    p.add_argument("--metrics-out", help="rank 0 writes the results as JSON")
    return p.parse_args()


if __name__ == "__main__":
    launch(main, parse_args())
