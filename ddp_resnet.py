#!/usr/bin/env python3
"""DistributedDataParallel ResNet training: rank 0 saves each epoch, every rank reloads it.

Follows AIME "Multi GPU training with PyTorch", part 2 (DistributedDataParallel), and the
checkpoint section of the official DDP tutorial (rank 0 saves, dist.barrier(), every rank
loads with map_location). Without --data it trains on synthetic in-memory images.

    python ddp_resnet.py                                  # one process per GPU, resnet50, batch 64 each
    python ddp_resnet.py --data /path/to/imagenet/train   # any ImageFolder root
    python ddp_resnet.py --resume                         # continue after the newest model_checkpoints/epoch_N.pt
    python ddp_resnet.py --cpu --nprocs 2 --arch resnet18 --image-size 64 --epochs 2 --max-steps 5
    torchrun --standalone --nproc-per-node=2 ddp_resnet.py --cpu --arch resnet18 --image-size 64 --epochs 2 --max-steps 5

Rank 0 prints `epoch 1/2 | step 5/5 | loss 6.9312 | 210 img/s` lines and a final line:
    done | epochs 2 | final_loss 6.9123 | 205 img/s | checkpoint model_checkpoints/epoch_2.pt
"""
import argparse
import hashlib
import io
import json
import os
import pickle
import re
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets.folder import is_image_file

POOL = 256  # distinct synthetic images kept in memory; larger --synthetic-size repeats them


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


class SyntheticImages(Dataset):
    """Images made once from the seed and held as tensors: no decoding or PIL work per sample,
    so images/s measures the model and not the CPU."""

    def __init__(self, size: int, image_size: int, num_classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(min(size, POOL), 3, image_size, image_size, generator=g)
        self.labels = torch.randint(num_classes, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i % len(self.images)], self.labels[i]


def load_data(args: argparse.Namespace, pin_memory: bool) -> tuple[DataLoader, DistributedSampler]:
    if args.data:
        transforms = T.Compose([
            T.Resize(round(args.image_size * 256 / 224)),  # the tutorial's 256 -> 224, at any size
            T.CenterCrop(args.image_size),
            T.ToTensor(),
            T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ])
        dataset = torchvision.datasets.ImageFolder(args.data, transform=transforms)  # fixed: `root=,` was a syntax error
    else:
        dataset = SyntheticImages(args.synthetic_size, args.image_size, args.num_classes, args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)  # same seed on every rank: disjoint shards
    # fixed: the tutorial's 4*num_gpus workers in every process is 4*num_gpus**2 in all; --workers is per process
    # drop_last: a last batch of one image would break BatchNorm in training
    dataloader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, sampler=sampler,
                            num_workers=args.workers, pin_memory=pin_memory, drop_last=True)
    if len(dataloader) == 0:  # every rank sees the same lengths, so every rank stops here
        sys.exit(f"error: {len(dataset)} images make no full batch of {args.batch_size} per process; lower --batch-size")
    return dataloader, sampler


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    # their auxiliary heads return tuples in training mode
    extra = {"aux_logits": False, "init_weights": True} if args.arch in ("googlenet", "inception_v3") else {}
    # fixed: pretrained=False is deprecated; weights=None is the same random init
    return torchvision.models.get_model(args.arch, weights=None, num_classes=args.num_classes, **extra)


def save_model(epoch: int, model, optimizer, args: argparse.Namespace) -> Path:
    """Write epoch_N.pt and, first, its sha256 (sha256sum's format) next to it, both atomically:
    a crash mid-save leaves no half-written file, and bytes altered later are caught on load."""
    folder = Path(args.ckpt_dir)
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"epoch_{epoch}.pt"  # fixed: no file.touch(), torch.save creates the file
    buffer = io.BytesIO()
    torch.save({"epoch": epoch, "model_state_dict": model.module.state_dict(),  # no "module." prefix
                "optimizer_state_dict": optimizer.state_dict(), "arch": args.arch,
                "num_classes": args.num_classes, "image_size": args.image_size}, buffer)
    data = buffer.getvalue()
    write_atomic(file.with_name(file.name + ".sha256"), f"{hashlib.sha256(data).hexdigest()}  {file.name}\n".encode())
    write_atomic(file, data)
    return file


def write_atomic(file: Path, data: bytes) -> None:
    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the data is on disk before the rename publishes it
    os.replace(tmp, file)


def read_checkpoint(file: Path, model, optimizer, args: argparse.Namespace, map_location, assign=False) -> None:
    """Load file into model and optimizer; anything wrong with it is one error line naming the file."""
    fix = "delete it (and its .sha256) to resume from the one before, or use another --ckpt-dir"
    try:
        data = file.read_bytes()
    except OSError as e:
        sys.exit(f"error: cannot read checkpoint {file} ({e.strerror}); {fix}")
    digest = file.with_name(file.name + ".sha256")
    if digest.is_file():
        if digest.read_text().split()[:1] != [hashlib.sha256(data).hexdigest()]:
            sys.exit(f"error: checkpoint {file} does not match {digest.name}: altered or damaged after it was written; {fix}")
    try:
        ckpt = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)  # data only, never code
    except Exception as e:  # truncated, corrupt, not a torch file, or objects weights_only refuses
        reason = " ".join(str(e).split("WeightsUnpickler error:")[-1].split())[:120] or "empty file"
        sys.exit(f"error: cannot read checkpoint {file} ({type(e).__name__}: {reason}); {fix}")
    if not isinstance(ckpt, dict) or not {"epoch", "model_state_dict", "optimizer_state_dict"} <= ckpt.keys():
        sys.exit(f"error: {file} is not a checkpoint of this script (needs epoch, model_state_dict, "
                 f"optimizer_state_dict); move it away or use another --ckpt-dir")
    try:
        model.load_state_dict(ckpt["model_state_dict"], assign=assign)
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    except Exception:  # missing or extra keys, other shapes, other optimizer groups
        sys.exit(f"error: {file} holds a {ckpt.get('arch', '?')} with {ckpt.get('num_classes', '?')} classes, "
                 f"not --arch {args.arch} --num-classes {args.num_classes}; pass those or use another --ckpt-dir")
    if not digest.is_file() and int(os.environ.get("RANK", "0")) == 0:  # e.g. copied without it
        print(f"warning: {file} has no {digest.name} next to it; loaded unverified", file=sys.stderr, flush=True)


def load_model(device: torch.device, epoch: int, model, optimizer, args: argparse.Namespace) -> None:
    """Every rank loads the checkpoint rank 0 wrote at the end of `epoch`."""
    # The barrier guards the read: no rank may open epoch_N.pt before rank 0's os.replace has
    # published it. It stands before the load, not after the save, because the readers are the
    # ones who must wait: so it also covers the first load of --resume, and nobody waits after the
    # last save, which nobody reads. No barrier after the load: the next save goes to a new file,
    # and the next epoch's all-reduces keep the ranks in step (the official tutorial's argument).
    dist.barrier()
    # fixed: {'cuda:0': f'cuda:{rank}'} fails on CPU and when the saver was not on cuda:0
    read_checkpoint(Path(args.ckpt_dir) / f"epoch_{epoch}.pt", model.module, optimizer, args, map_location=device)


def newest_checkpoint(folder: str):
    found = [(int(m[1]), p) for p in Path(folder).glob("epoch_*.pt") if (m := re.fullmatch(r"epoch_(\d+)\.pt", p.name))]
    return max(found, default=(0, None))


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over all parameters and buffers, independent of memory format."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU runs ahead of Python: wait before reading the clock


def run_training_process_on_given_gpu(local_rank: int, args: argparse.Namespace) -> None:
    device = ddp_setup(local_rank, args.nprocs, args.cpu, args.timeout)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if (rank == 0 and dist.get_backend() == "gloo" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
            # Restarted gloo workers that share torchrun's store can fail in connectFullMesh with
            # "Connection refused" (pytorch/pytorch#135712); the variable gives each round its own store.
            print("warning: torchrun --max-restarts on gloo: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                  "or a restart may fail with 'Connection refused'", file=sys.stderr, flush=True)
        torch.backends.cudnn.benchmark = True  # fixed input size: pick the fastest kernels once
        fmt = torch.channels_last if args.channels_last else torch.contiguous_format
        torch.manual_seed(args.seed)
        model = build_model(args).to(device, memory_format=fmt)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
        criterion = torch.nn.CrossEntropyLoss()
        dataloader, sampler = load_data(args, pin_memory=device.type == "cuda")
        total_steps = min(len(dataloader), args.max_steps or len(dataloader))
        model.train()
        steps, final_loss, checkpoint, digest, rates = 0, None, None, None, []
        for epoch in range(args.start_epoch, args.epochs + 1):  # fixed: range(1, num_epochs) ran one epoch short
            if epoch > 1:
                load_model(device, epoch - 1, model, optimizer, args)
                digest = param_digest(model.module)
            sampler.set_epoch(epoch)  # fixed: without it every epoch repeats the same order
            loss_sum, n, t0, seen = torch.zeros((), device=device), 0, None, 0
            if args.warmup_steps == 0:
                sync(device)
                t0 = time.perf_counter()
            for step, (images, labels) in enumerate(dataloader, 1):
                images = images.to(device, non_blocking=True, memory_format=fmt)
                labels = labels.to(device, non_blocking=True)
                # bf16 autocast is meant for GPUs (no GradScaler needed for bf16); on CPU it works, slowly
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                    loss = criterion(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach()
                n, seen = n + 1, seen + images.size(0)
                # Time windows of --log-every steps after --warmup-steps in each epoch: the first epoch
                # warms cuDNN and the allocator, later ones restart the loader after the reload.
                if step >= args.warmup_steps and (step - args.warmup_steps) % args.log_every == 0:
                    sync(device)
                    now = time.perf_counter()
                    if t0 is not None:
                        rates.append(seen / (now - t0))
                    t0, seen = now, 0
                if step % args.log_every == 0 or step == total_steps:
                    rate = f"{rates[-1] * world_size:.0f}" if rates else "-"  # rank 0's window times world size
                    print0(f"epoch {epoch}/{args.epochs} | step {step}/{total_steps} | loss {loss.item():.4f} | {rate} img/s")
                if step == total_steps:
                    break
            steps += n
            totals = torch.stack([loss_sum, torch.tensor(float(n), device=device)])
            dist.all_reduce(totals)  # the mean over every rank's steps, not rank 0's share alone
            final_loss = (totals[0] / totals[1]).item()
            if rank == 0:  # global rank: with LOCAL_RANK every node would write its own copy
                checkpoint = save_model(epoch, model, optimizer, args)
        if digest is None:  # no reload happened in this run
            digest = param_digest(model.module)
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, (digest, memory))
        # One all-reduce sums the ranks: [median window rate, window 1, window 2, ...]; every rank
        # ran the same number of windows because DistributedSampler gives each the same length.
        summed = torch.tensor([statistics.median(rates) if rates else 0.0] + rates, dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        images_per_sec = summed[0].item() if rates else None
        epochs_run = len(range(args.start_epoch, args.epochs + 1))
        ips = f"{images_per_sec:.0f}" if images_per_sec else "-"
        loss_text = f"{final_loss:.4f}" if final_loss is not None else "-"
        print0(f"done | epochs {epochs_run} | final_loss {loss_text} | {ips} img/s | checkpoint {checkpoint or '-'}")
        if rank == 0 and args.metrics_out:
            write_json(args.metrics_out, {
                "script": "ddp_resnet.py", "world_size": world_size, "backend": dist.get_backend(),
                "device": device.type, "arch": args.arch, "epochs_run": epochs_run,
                "steps": steps, "final_loss": final_loss, "images_per_sec": images_per_sec,
                "window_images_per_sec": summed[1:].tolist(),
                "max_memory_gib": [m for _, m in per_rank] if memory is not None else None,
                "checkpoint": str(checkpoint) if checkpoint else None, "resumed_from": args.resumed_from,
                "param_sha256_per_rank": [d for d, _ in per_rank],
            })
    finally:
        cleanup()


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags, data and checkpoints before any process starts; fill in the defaults."""
    check_launch(args)
    for flag in ("epochs", "batch_size", "lr", "image_size", "synthetic_size", "log_every", "max_steps", "num_classes"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            sys.exit(f"error: --{flag.replace('_', '-')} must be positive, got {value}")
    for flag in ("momentum", "weight_decay", "warmup_steps", "workers"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            sys.exit(f"error: --{flag.replace('_', '-')} must not be negative, got {value}")
    if args.arch not in torchvision.models.list_models(module=torchvision.models):
        sys.exit(f"error: --arch {args.arch} is not a torchvision classification model; try resnet18 or resnet50")
    classes = 1000
    if args.data:
        if not os.path.isdir(args.data):
            sys.exit(f"error: --data {args.data} is not a folder; pass an ImageFolder root (one sub-folder per class) "
                     f"or leave --data out for synthetic images")
        folders = sorted(e.path for e in os.scandir(args.data) if e.is_dir())
        if not folders:  # ImageFolder would fail later, in every rank, with a traceback
            sys.exit(f"error: --data {args.data} has no class folders; an ImageFolder root holds one sub-folder of images per class")
        for c in folders:
            if not any(is_image_file(f) for _, _, fs in os.walk(c, followlinks=True) for f in fs):
                sys.exit(f"error: --data: class folder {c} holds no images (.jpg, .png, ...); add some or remove the folder")
        classes = len(folders)
        if args.num_classes is not None and args.num_classes < classes:
            sys.exit(f"error: --num-classes {args.num_classes} but --data has {classes} class folders; leave it out")
    elif -(-args.synthetic_size // int(os.environ.get("WORLD_SIZE", args.nprocs))) < args.batch_size:  # per rank, rounded up
        sys.exit(f"error: --synthetic-size {args.synthetic_size} makes no full batch of {args.batch_size} per process; "
                 f"raise it or lower --batch-size")
    args.num_classes = args.num_classes or classes
    if args.workers is None:
        args.workers = 0 if args.cpu or not torch.cuda.is_available() else 4  # the tutorial's 4 per GPU
    args.start_epoch, args.resumed_from = 1, None
    if args.resume:
        epoch, file = newest_checkpoint(args.ckpt_dir)
        if file is None:
            print0(f"--resume: no checkpoint in {args.ckpt_dir}, starting fresh")
            return
        with torch.device("meta"):  # check that it fits the model without building the weights twice
            model = build_model(args)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        read_checkpoint(file, model, optimizer, args, map_location="cpu", assign=True)
        args.start_epoch, args.resumed_from = epoch + 1, epoch
        print0(f"--resume: continuing after {file}, epochs {epoch + 1}..{args.epochs}" if epoch < args.epochs
               else f"--resume: {file} already reached --epochs {args.epochs}, nothing to train")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nprocs", type=int, default=default_nprocs(), help="processes to spawn (ignored under torchrun); default: GPUs, or 2 on CPU")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even where GPUs exist")
    p.add_argument("--epochs", type=int, default=30, help="train epochs 1..N")
    p.add_argument("--batch-size", type=int, default=64, help="per process, as in the tutorial")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0, help="model init, synthetic data and shuffling")
    p.add_argument("--max-steps", type=int, help="stop each epoch after N steps (smoke runs)")
    p.add_argument("--data", help="ImageFolder root; without it, synthetic in-memory images")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--arch", default="resnet50", help="any torchvision classification model")
    p.add_argument("--num-classes", type=int, help="default: the ImageFolder's class count, or 1000")
    p.add_argument("--synthetic-size", type=int, default=12800, help=f"synthetic images per epoch ({POOL} distinct)")
    p.add_argument("--workers", type=int, help="DataLoader workers per process; default: 4 on GPU, 0 on CPU")
    p.add_argument("--amp", action="store_true", help="bf16 autocast (meant for GPUs)")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    p.add_argument("--ckpt-dir", default="model_checkpoints", help="where rank 0 writes epoch_N.pt")
    p.add_argument("--resume", action="store_true", help="continue after the newest checkpoint in --ckpt-dir")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait")
    p.add_argument("--log-every", type=int, default=10, help="progress line and throughput window every N steps")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps per epoch left out of images/s")
    p.add_argument("--metrics-out", help="rank 0 writes the results here as JSON")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    check_args(args)
    launch(run_training_process_on_given_gpu, args)
