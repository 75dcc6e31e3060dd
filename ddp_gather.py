"""Gather per-rank objects and tensors (Comprehensive Tutorial to PyTorch DDP, sec. 6).

    python ddp_gather.py          # one process per GPU, or 2 CPU processes
    torchrun --standalone --nproc-per-node=3 ddp_gather.py --cpu   # gloo, 3 ranks

Rank 0 prints the gathered dicts and tensors, then, with 2 ranks,
`done | gathered 2 objects | backend gloo`.
"""

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


def main(local_rank, args):
    device = ddp_setup(local_rank, args)
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    tensor = torch.ones(3, device=device) + rank
    data = {
        # to the CPU (the tutorial sends it from the GPU): a GPU tensor is pickled
        # with its device, so every rank would unpickle it onto the sender's GPU and
        # use memory there
        "tensor": tensor.cpu(),
        # fixed: the tutorial's [1, 2, 3] + rank fails
        "list": [x + rank for x in [1, 2, 3]],
        "dict": {"rank": rank},
    }
    # all_gather_object takes any picklable object, but unpickling can run code that
    # the sender chose: trusted peers only. It fills one place per rank, in rank order.
    outputs = [None] * world_size
    dist.all_gather_object(outputs, data)
    # all_gather takes same-shaped tensors and no pickle: for large or per-step data
    tensors = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(tensors, tensor)
    if rank == 0:
        print(outputs)
        print(f"all_gather: {[t.tolist() for t in tensors]}")
        print(f"done | gathered {len(outputs)} objects | backend {dist.get_backend()}")
        if args.metrics_out:
            results = dict(
                script=Path(__file__).name, world_size=world_size, gathered=outputs
            )
            # tensors are written as lists
            text = json.dumps(results, default=torch.Tensor.tolist)
            Path(args.metrics_out).write_text(text)
    dist.destroy_process_group()


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
    return p.parse_args()


if __name__ == "__main__":
    launch(main, parse_args())
