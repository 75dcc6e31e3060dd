"""What one GPU shows of each GPU-only guard, and where an amp+channels-last DDP step's time
goes: the model's step alone, the loader alone, and a loader that decodes JPEGs. One line each.
Not in the suite; tests/gpu_check.sh runs it after a GPU run has saved CKPT (on a CPU it runs
smaller, to try it).

    python tests/gpu_probe.py CKPT        # CKPT: a checkpoint that a GPU run saved
"""

import os
import socket
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import parallel_apply

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddp_resnet  # noqa: E402
import dp_resnet  # noqa: E402


def main():
    ckpt = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    cuda = torch.cuda.is_available()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    size = (
        ["--arch", "resnet50", "--batch-size", "256"]
        if cuda
        else ["--cpu", "--arch", "resnet18", "--image-size", "32", "--batch-size", "8"]
    )
    sys.argv = ["ddp_resnet.py", "--amp", "--channels-last", *size]
    args = ddp_resnet.parse_args()
    device = ddp_resnet.ddp_setup(0, args)

    def timed(n, fn):
        """Seconds for n calls of fn after 3 warm-up calls, the device's work included."""
        for _ in range(3):
            fn()
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - began

    # set_device before the first collective
    group = dist.distributed_c10d._get_default_group()
    current = torch.cuda.current_device() if cuda else "-"
    print(
        f"set_device: ddp_setup(local_rank 0) -> {device}, current_device {current},"
        f" the group bound to {group.bound_device_id} before any collective"
    )

    # map_location onto the rank's own device
    if ckpt:
        saved = next(iter(torch.load(ckpt, weights_only=True)["model_state_dict"].values()))
        mapped = torch.load(ckpt, map_location="cpu", weights_only=True)
        mapped = next(iter(mapped["model_state_dict"].values()))
        print(
            f"map_location: {ckpt.name} holds tensors on {saved.device}; torch.load without"
            f" map_location puts them there, with map_location='cpu' on {mapped.device}"
        )

    # DataParallel's bf16 inside the replicas: parallel_apply is what DataParallel runs, a thread
    # per copy; two copies on one GPU show what each thread's autocast does
    if cuda:
        net = torch.nn.Conv2d(3, 8, 3).to(device)
        x = torch.randn(2, 3, 16, 16, device=device)
        copies = [net, dp_resnet.Bf16Autocast(net)]
        found = []
        # each in an autocast of its own: autocast keeps a cast of the weights until it ends
        with torch.autocast(device.type, torch.bfloat16):
            found.append(net(x).dtype)
        for copy in copies:
            with torch.autocast(device.type, torch.bfloat16):
                try:
                    out = parallel_apply([copy, copy], [(x,), (x,)], devices=[device] * 2)
                    found.append(out[0].dtype)
                except RuntimeError as e:
                    found.append(f"{type(e).__name__}: {str(e).splitlines()[-1]}")
        print(
            f"DataParallel bf16: train()'s autocast gives {found[0]} in its own thread; a copy"
            f" in DataParallel's thread gives {found[1]}; inside Bf16Autocast {found[2]}"
        )

    # pin_memory and non_blocking
    train_set, _, classes = ddp_resnet.load_datasets(args)
    loader = ddp_resnet.prepare_dataloader(train_set, device, args)
    images, _ = next(iter(loader))
    host = torch.randn(images.shape)
    pinned = host.pin_memory() if cuda else host
    mb = host.numel() * 4 / 1e6
    pageable_s = timed(10, lambda: host.to(device)) / 10
    pinned_s = timed(10, lambda: pinned.to(device, non_blocking=True)) / 10
    began = time.perf_counter()
    pinned.to(device, non_blocking=True)
    returned_ms = (time.perf_counter() - began) * 1e3
    print(
        f"pin_memory: the loader's batch is pinned: {images.is_pinned()}; a {mb:.0f} MB batch"
        f" to the GPU: pageable {mb / 1e3 / pageable_s:.1f} GB/s, pinned {mb / 1e3 / pinned_s:.1f}"
        f" GB/s; .to(non_blocking=True) returns after {returned_ms:.2f} ms of a"
        f" {pinned_s * 1e3:.1f} ms copy"
    )

    # where the time goes: the step alone, on a batch already on the GPU
    batch = args.batch_size
    model = ddp_resnet.DDP(
        ddp_resnet.build_model(args, classes).to(device, memory_format=torch.channels_last)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    on_gpu = images.to(device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (batch,), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(on_gpu), labels)
        loss.backward()
        optimizer.step()

    steps = 20 if cuda else 3
    step_rate = steps * batch / timed(steps, step)

    def drain(loader, n):
        """Images/s of the loader alone, the copy to the device included, over the second half
        of n batches: the workers have started, and the first batches they made at once are
        behind."""
        arrived = []
        for images, _ in islice(loader, n):
            images.to(device, non_blocking=True)
            if cuda:
                torch.cuda.synchronize()
            arrived.append((time.perf_counter(), len(images)))
        half = len(arrived) // 2
        images = sum(count for _, count in arrived[half + 1 :])
        return images / (arrived[-1][0] - arrived[half][0])

    synthetic_rate = drain(loader, 4 * steps)
    print(
        f"time split ({args.arch}, {args.image_size} px, batch {batch}, bf16,"
        f" channels_last): the step alone {step_rate:.0f} images/s; the loader alone on"
        f" synthetic tensors ({args.workers} workers) {synthetic_rate:.0f} images/s"
    )

    # what real JPEGs give: the script's own ImageFolder and transforms, decoded by the workers
    with tempfile.TemporaryDirectory() as root:
        count = 2048 if cuda else 64
        pictures = []
        for _ in range(8):
            # smooth pictures of ImageNet's typical size: noise would not compress
            small = torch.randint(0, 256, (1, 3, 12, 16), dtype=torch.uint8).float()
            pixels = torch.nn.functional.interpolate(small, (375, 500), mode="bilinear")
            array = pixels[0].byte().permute(1, 2, 0).numpy()
            file = Path(root, f"{len(pictures)}.jpg")
            Image.fromarray(array).save(file, quality=90)
            pictures.append(file.read_bytes())
        for i in range(count):
            folder = Path(root, "images", f"class{i % 2}")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i}.jpg").write_bytes(pictures[i % 8])
        for workers in sorted({args.workers, os.cpu_count()}):
            args.data = str(Path(root, "images"))
            args.workers, args.batch_size = workers, min(batch, 32)
            jpegs, _, _ = ddp_resnet.load_datasets(args)
            loader = ddp_resnet.prepare_dataloader(jpegs, device, args)
            rate = drain(loader, count // args.batch_size)
            print(
                f"JPEGs (500x375, {count} files, the script's transforms to"
                f" {args.image_size} px): {workers} workers decode {rate:.0f} images/s"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
