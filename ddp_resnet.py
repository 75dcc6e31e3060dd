"""DDP ResNet (AIME part 2, the DDP tutorial's checkpoints): rank 0 saves, all reload.

    python ddp_resnet.py          # one process per GPU, or 2 CPU processes
    # or let torchrun, PyTorch's launcher, start the processes (--standalone: on
    # this machine alone; it also runs on several machines, see launch()):
    torchrun --standalone --nproc-per-node=2 ddp_resnet.py --cpu --arch resnet18
    # a run of seconds on a CPU:
    python ddp_resnet.py --cpu --arch resnet18 --image-size 32 --epochs 2 --max-steps 3

Rank 0 prints `start | ...`, progress lines, one line per epoch and `done | ...`.
Run again with --resume to go on after the newest checkpoint in --ckpt-dir.
"""

import argparse
import io
import json
import os
import signal
import sys
import time
from datetime import timedelta
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision.transforms as T
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
from torchvision import datasets, models


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
    """The training set, the validation set (or None), and the number of classes."""
    size = args.image_size
    # ImageNet's mean and standard deviation per colour
    normalize = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    # the tutorial's Resize(256) and CenterCrop(224) at any --image-size: resize to
    # 8/7 of the crop
    preprocess = T.Compose(
        [T.Resize(size * 8 // 7), T.CenterCrop(size), T.ToTensor(), normalize]
    )
    if args.data:
        # fixed: the tutorial's ImageFolder(root=, ...) is a syntax error
        train = datasets.ImageFolder(args.data, transform=preprocess)
    else:
        # 256 random images, one per class, each 50 times: 12,800 that a model can
        # learn and no files to decode; the same in every rank, as each calls
        # torch.manual_seed(args.seed) first
        images = TensorDataset(torch.randn(256, 3, size, size), torch.arange(256))
        train = Subset(images, [i % 256 for i in range(12800)])
        # the class names, as an ImageFolder has them
        train.classes = [str(c) for c in range(256)]
    val = None
    if args.val_data:
        val = datasets.ImageFolder(args.val_data, transform=preprocess)
        # the same classes in the same order, or the labels mean other things
        if val.classes != train.classes:
            raise ValueError(
                "its classes are not the training data's; in one of the two only:"
                f" {sorted(set(val.classes) ^ set(train.classes))[:10]}"
            )
    return train, val, len(train.classes)


def build_model(args, num_classes):
    # fixed: pretrained=False is deprecated; weights=None is the same random init
    return models.get_model(args.arch, weights=None, num_classes=num_classes)


def prepare_dataloader(train_set, device, args):
    # each rank its own shuffled share of the data
    sampler = DistributedSampler(train_set, seed=args.seed)
    # Not a part of DDP; it matters with --workers above 0 (the default with GPUs).
    # A fork of this rank, which runs gloo's or NCCL's threads, can hang on a lock
    # one of them held. So loader workers, here and in evaluate, start from a
    # forkserver: a clean process that imports torchvision once, then forks them.
    # force=True: a rank that mp.spawn started has a start method set already.
    mp.set_forkserver_preload(["torchvision"])
    mp.set_start_method("forkserver", force=True)
    return DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        # fixed: per rank; the tutorial's 4 * GPUs in each rank made 4 * GPUs * GPUs
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        # a last batch of 1 image can be too few for BatchNorm (see check_args)
        drop_last=True,
    )


def train(model, dataloader, optimizer, device, epoch, steps, args):
    """One epoch of at most `steps` steps: its mean loss over every rank's steps, and
    its speed."""
    # fixed: without set_epoch every epoch has the same order
    dataloader.sampler.set_epoch(epoch)
    # Each rank and epoch its own seed: the ranks draw different random numbers
    # (loader-worker seeds; dropout or augmentation, in a model or data of your own),
    # and a resumed run draws what an unbroken run drew. hash() of ints does not
    # depend on PYTHONHASHSEED: the same seed in every run.
    torch.manual_seed(hash((args.seed, epoch, dist.get_rank())))
    global_batch = args.batch_size * dist.get_world_size()
    # summed on the device: .item() at every step would wait for it
    loss_sum = torch.zeros((), device=device)
    began = time.monotonic()
    last_print = began
    for step, (images, labels) in enumerate(islice(dataloader, steps), start=1):
        # args.memory_format: channels_last with --channels-last (set in parse_args).
        # non_blocking: the copy of a pinned batch overlaps the GPU's work (the labels
        # are too small to matter).
        images = images.to(device, non_blocking=True, memory_format=args.memory_format)
        optimizer.zero_grad(set_to_none=True)
        # --amp: bf16, which needs no GradScaler
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):
            loss = torch.nn.functional.cross_entropy(model(images), labels.to(device))
        # DDP averages every rank's gradients here
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach().float()
        # a line every --log-every steps, and at least every 30 s
        if step % args.log_every == 0 or time.monotonic() - last_print > 30:
            # .item() waits for the device, so the time after it is true
            value = loss.item()
            last_print = time.monotonic()
            seconds = last_print - began
            rate = step * global_batch / seconds
            print0(
                f"epoch {epoch}/{args.epochs} | step {step}/{steps} | loss {value:.4f}"
                f" | {rate:.0f} img/s | {seconds:.1f} s"
            )
    # fixed: the tutorial prints rank 0's loss alone; this is the mean of every
    # rank's steps
    dist.all_reduce(loss_sum)
    loss = loss_sum.item() / steps / dist.get_world_size()
    seconds = time.monotonic() - began
    # final_loss: this epoch's mean loss. Each epoch's replaces the one before in
    # results, so the metrics JSON's final_loss is the last epoch's.
    return dict(
        final_loss=loss, images_per_sec=steps * global_batch / seconds, seconds=seconds
    )


@torch.no_grad()
def evaluate(model, val_set, device, args):
    """Top-1 accuracy, each image once: a DistributedSampler would pad the shares to
    equal length with repeated images."""
    # Every rank scores the same model: rank 0's, the one saved. BatchNorm's running
    # statistics (buffers) differ between the ranks now: DDP copies rank 0's to the
    # others at the start of each forward (broadcast_buffers, on by default), but
    # that forward then updates each rank's from its own batch. So copy rank 0's.
    # (model.module: the model inside DDP.)
    for buffer in model.module.buffers():
        dist.broadcast(buffer, src=0)
    # every world_size-th image, from this rank's number on
    share = Subset(val_set, range(dist.get_rank(), len(val_set), dist.get_world_size()))
    # [correct, seen]
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    model.eval()
    for images, labels in DataLoader(share, args.batch_size, num_workers=args.workers):
        # model.module, not DDP's forward: that can broadcast the buffers (even here,
        # in eval mode without gradients), a collective that every rank must join. The
        # ranks' shares can differ by a batch: one rank would call it alone, and hang.
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):
            logits = model.module(images.to(device, memory_format=args.memory_format))
        counts[0] += (logits.argmax(1) == labels.to(device)).sum()
        counts[1] += len(labels)
    model.train()
    # [correct, seen] of every rank; a rank with an empty share adds zeros
    dist.all_reduce(counts)
    correct, seen = counts.tolist()
    return dict(val_accuracy=correct / seen, val_correct=correct, val_samples=seen)


def newest_epoch(args):
    """N of the newest epoch_N.pt in --ckpt-dir, 0 if there is none."""
    numbers = [
        file.stem.removeprefix("epoch_")
        for file in Path(args.ckpt_dir).glob("epoch_*.pt")
    ]
    return max([int(n) for n in numbers if n.isdigit()], default=0)


def save_model(epoch, model, optimizer, args):
    """Atomic: written to a .tmp file, fsynced, then renamed over epoch_N.pt. A
    failure ends this rank with one line; the others then fail in their next
    collective, and the launcher stops them."""
    # fixed: no file.touch() first: torch.save makes the file
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"
    tmp = Path(f"{file}.tmp")
    # model.module: the bare model's keys, with no "module." prefix
    ckpt = dict(
        epoch=epoch,
        model_state_dict=model.module.state_dict(),
        optimizer_state_dict=optimizer.state_dict(),
    )
    # Serialized in memory (a second copy, for a moment), then written by us: a full
    # disk is then an OSError that says "No space left on device"; torch.save to a
    # file would fail in its C++ writer with a message that does not say why.
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            # on disk before the rename publishes it
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except OSError as e:
        sys.exit(
            f"error: cannot save {file} ({e.strerror}); fix that, rerun with --resume"
        )
    finally:
        tmp.unlink(missing_ok=True)
    return str(file)


def load_model(epoch, model, optimizer, device, args):
    """Every rank loads the file rank 0 saved: on several nodes, --ckpt-dir is a
    folder they share."""
    # Every rank waits here until rank 0 has saved the file. No barrier is needed
    # after the load: each rank only reads it, and the next step's collectives keep
    # the ranks together.
    dist.barrier()
    file = Path(args.ckpt_dir) / f"epoch_{epoch}.pt"
    # fixed: map_location onto this rank's own device (the tutorial's cuda:0->cuda:rank
    # map fails on a CPU). weights_only: loading a checkpoint runs no code of its own.
    ckpt = torch.load(file, map_location=device, weights_only=True)
    model.module.load_state_dict(ckpt["model_state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_state_dict"])


def new_results(model, device, steps):
    """What runs where, for the start line; train and evaluate add their results."""
    return dict(
        script=Path(__file__).name,
        world_size=dist.get_world_size(),
        device=device.type,
        backend=dist.get_backend(),
        model=type(model.module).__name__,
        steps=steps,
    )


def run_training_process_on_given_gpu(local_rank, args):
    device = ddp_setup(local_rank, args)
    # the except at the end: when a peer dies, this rank waits a moment before it
    # fails, so that the launcher reports the peer, the cause
    try:
        # --seed: the synthetic images the same on every rank, and the initial weights
        # the same in every run. (DDP copies rank 0's weights to the other ranks, and
        # train() reseeds each rank for its own random numbers.)
        torch.manual_seed(args.seed)
        train_set, val_set, num_classes = load_datasets(args)
        dataloader = prepare_dataloader(train_set, device, args)
        model = build_model(args, num_classes)
        model = model.to(device, memory_format=args.memory_format)
        # the model is on this rank's device already, so DDP needs no device_ids
        model = DDP(model)
        params = model.parameters()
        optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
        # --max-steps, where given, ends each epoch early
        steps = min(len(dataloader), args.max_steps or len(dataloader))
        # Epoch 1, or with --resume the one after rank 0's newest checkpoint. Rank 0
        # looks in --ckpt-dir and every rank starts where it says: a node whose listing
        # differs (a stale extra file, say) cannot pick another epoch.
        start = torch.tensor(1, device=device)
        if dist.get_rank() == 0 and args.resume:
            start += newest_epoch(args)
        dist.broadcast(start, src=0)
        first_epoch = start.item()
        results = new_results(model, device, steps)
        # start_line, log_line and report (after the launching section) only format
        # the results and write them
        print0(start_line(results, first_epoch, args))
        # fixed: the tutorial's range(1, 30) ran 29 epochs
        for epoch in range(first_epoch, args.epochs + 1):
            # The tutorial's pattern: each epoch starts from the checkpoint that rank 0
            # saved. The ranks' weights agree already; this shows the load, and it is
            # the first load of a resumed run.
            if epoch > 1:
                load_model(epoch - 1, model, optimizer, device, args)
            trained = train(model, dataloader, optimizer, device, epoch, steps, args)
            results.update(trained)
            # the global rank, one writer in all: the tutorial's rank == 0 is the spawn
            # index, which on several machines is 0 once on each
            if dist.get_rank() == 0:
                results["checkpoint"] = save_model(epoch, model, optimizer, args)
            # every rank evaluates, also one whose share of the validation set is
            # empty: the others wait for its counts
            if val_set is not None:
                results.update(evaluate(model, val_set, device, args))
            keys = "final_loss", "val_accuracy", "images_per_sec", "seconds"
            print0(log_line(f"epoch {epoch}/{args.epochs}", results, *keys))
        # --resume of a run that reached --epochs trains nothing, but scores again
        if val_set is not None and first_epoch > args.epochs:
            load_model(first_epoch - 1, model, optimizer, device, args)
            results.update(evaluate(model, val_set, device, args))
        report(results, first_epoch, args)
        # a workaround: we saw a gloo run on torch 2.11 hang at exit unless DDP's
        # model was gone before its process group
        del model
        dist.destroy_process_group()
    except RuntimeError as e:
        # A collective whose peer died raises this (the three phrases are gloo's and
        # NCCL's for a lost connection). This rank waits 3 s before it fails: mp.spawn
        # reports the first rank to end, and that should be the peer, the cause.
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


def report(results, first_epoch, args):
    """The done line, and the results in --metrics-out."""
    results["epochs_run"] = max(0, args.epochs + 1 - first_epoch)
    keys = "epochs_run", "final_loss", "val_accuracy", "checkpoint"
    print0(log_line("done", results, *keys))
    if dist.get_rank() == 0 and args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(results, indent=1))


def log_line(head, results, *keys):
    """`head | key value | ...` for those of the keys that results has."""
    parts = [head]
    for key in keys:
        if key in results:
            value = results[key]
            if type(value) is float:
                value = f"{value:.4g}"
            parts.append(f"{key} {value}")
    return " | ".join(parts)


def start_line(results, first_epoch, args):
    """`start | key value | ...`, then the epochs to run and the checkpoint they go
    on from."""
    head = log_line("start", results, *results.keys())
    last = Path(args.ckpt_dir) / f"epoch_{first_epoch - 1}.pt"
    if first_epoch > args.epochs:
        return f"{head} | nothing to train: {last} reached --epochs {args.epochs}"
    epochs = f"epochs {first_epoch}-{args.epochs}"
    if first_epoch > 1:
        return f"{head} | resuming from {last} | {epochs}"
    return f"{head} | {epochs}"


def check_args(args):
    """Refuse bad input in one line each, before any rank starts."""
    if args.workers < 0:
        sys.exit(f"error: --workers {args.workers}: use 0 or more")
    # ImageFolder raises for a missing folder, no class folders, a class without images
    try:
        train_set, _, num_classes = load_datasets(args)
    except (OSError, ValueError) as e:
        # Name the flag whose folder failed: --val-data, unless --data's folder
        # fails when loaded alone (ImageFolder's faults are all OSErrors). With
        # neither flag given (a copy of this script that loads data its own way),
        # the error is printed alone.
        flag = ""
        if args.val_data:
            flag = f"--val-data {args.val_data}: "
        if args.data:
            try:
                datasets.ImageFolder(args.data)
            except OSError:
                flag = f"--data {args.data}: "
        sys.exit(f"error: {flag}{e}")
    # the ranks: --nprocs spawned here, or the WORLD_SIZE of a group joined (RANK;
    # ddp_setup refuses a RANK without a WORLD_SIZE)
    processes = args.nprocs
    if os.environ.get("RANK"):
        processes = int(os.environ.get("WORLD_SIZE") or 1)
    # drop_last: fewer images than one global batch would leave no step at all
    if len(train_set) < args.batch_size * processes:
        sys.exit(
            f"error: {len(train_set)} images, too few for"
            f" --batch-size {args.batch_size} x {processes} processes"
        )
    # BatchNorm cannot train on one value per channel. A ResNet shrinks an image
    # 32-fold: with 1 image at 32 px, its last block sees 1x1 maps, one value per
    # channel (at 224 px, 7x7: 1 image trains). Ask the model: a fresh one is in
    # training mode, and its BatchNorm raises ValueError.
    if args.batch_size == 1:
        try:
            # the first training image, as a batch of 1
            build_model(args, num_classes)(train_set[0][0].unsqueeze(0))
        except ValueError as e:
            sys.exit(
                f"error: --batch-size 1 gives each rank 1 image, too few at"
                f" --image-size {args.image_size} ({e}); use a larger --batch-size"
                " or --image-size"
            )
    check_ckpt_dir(args, num_classes)


def check_ckpt_dir(args, num_classes):
    """Refuse another run's checkpoints, and a folder or checkpoint we cannot use."""
    newest = newest_epoch(args)
    file = Path(args.ckpt_dir) / f"epoch_{newest}.pt"
    # another run's checkpoints: a later --resume would go on from them
    if newest and not args.resume:
        sys.exit(
            f"error: {file} exists: add --resume to go on from it,"
            " or use another --ckpt-dir"
        )
    # a file in the folder's place, a read-only disk, a damaged checkpoint, another
    # model's checkpoint
    try:
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
        if newest:
            ckpt = torch.load(file, map_location="cpu", weights_only=True)
            build_model(args, num_classes).load_state_dict(ckpt["model_state_dict"])
    except Exception as e:
        # torch's own words on one line; a weights_only failure puts its reason
        # after "WeightsUnpickler error:", below long advice
        why = str(e).split("WeightsUnpickler error:")[-1]
        why = " ".join(why.split())
        action = f"resume from {file}" if newest else "make --ckpt-dir"
        sys.exit(f"error: cannot {action}: {why[:300]}")


def add_data_and_model_flags(p):
    """The flags that only load_datasets and build_model read: a copy that replaces
    those two functions replaces these too."""
    p.add_argument("--data", help="an ImageFolder root; without it, synthetic images")
    p.add_argument("--val-data", help="an ImageFolder root with --data's classes")
    p.add_argument("--image-size", type=positive, default=224)
    # every classification model in torchvision.models
    p.add_argument("--arch", default="resnet50", choices=models.list_models(models))


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
    p.add_argument("--epochs", type=positive, default=30)
    p.add_argument("--batch-size", type=positive, default=64, help="per process")
    p.add_argument(
        "--lr", type=float, default=0.01, help="SGD, momentum 0.9, weight decay 1e-4"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="initial weights, order, synthetic data"
    )
    p.add_argument("--max-steps", type=positive, help="end each epoch after N steps")
    p.add_argument(
        "--log-every", type=positive, default=10, help="a line every N steps"
    )
    add_data_and_model_flags(p)
    # 4 a rank where GPUs are visible; else none: they would compete with the ranks
    # for the cores
    p.add_argument("--workers", type=int, default=4 if gpus else 0, help="per rank")
    p.add_argument("--amp", action="store_true", help="bf16 autocast, for GPUs")
    p.add_argument(
        "--channels-last", action="store_true", help="NHWC memory format, for GPUs"
    )
    p.add_argument(
        "--ckpt-dir", default="model_checkpoints", help="rank 0 saves epoch_N.pt here"
    )
    p.add_argument(
        "--resume", action="store_true", help="go on after the newest epoch_N.pt"
    )
    args = p.parse_args()
    args.memory_format = torch.contiguous_format
    if args.channels_last:
        args.memory_format = torch.channels_last
    return args


if __name__ == "__main__":
    args = parse_args()
    # Who checks the input: this process, where it spawns the ranks (RANK unset;
    # a LOCAL_RANK a shell left behind does not matter then). Under torchrun, the
    # process with LOCAL_RANK 0 on each node, as each node reads its own folders;
    # the others wait in ddp_setup (torchrun stops them if a check refuses).
    if not os.environ.get("RANK") or os.environ.get("LOCAL_RANK", "0") == "0":
        check_args(args)
    launch(run_training_process_on_given_gpu, args)
