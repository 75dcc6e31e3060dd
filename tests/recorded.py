"""Run a script with what its ranks draw and compute written down, for the tests of its fixes.

    torchrun --standalone --nproc-per-node=2 tests/recorded.py OUT ddp_resnet.py [flags]
    python tests/recorded.py OUT dp_resnet.py [flags]

Each process runs the script unchanged (as __main__, as the launcher would) and at exit writes
OUT.RANK.json: per pass over a training sampler its order of indices, every training loss with
the pass it belongs to, each DataLoader's workers and the files it downloaded. Spawned ranks
are fresh interpreters without these recorders: DDP scripts go through torchrun here.
FMNIST_MIRROR=URL makes torchvision download FashionMNIST from there, without its checksums
(a local copy of the files stands in for the internet)."""

import json
import os
import runpy
import sys
from pathlib import Path

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler  # noqa: E402

seen = {"draws": [], "losses": [], "workers": [], "downloads": []}


def recording(cls):
    iterate = cls.__iter__

    def __iter__(self):
        order = list(iterate(self))
        seen["draws"].append(order)
        return iter(order)

    cls.__iter__ = __iter__


for cls in (DistributedSampler, RandomSampler):
    recording(cls)

cross_entropy, loader_iter = torch.nn.functional.cross_entropy, DataLoader.__iter__


def loss_of(*inputs, **kwargs):  # CrossEntropyLoss calls it too
    loss = cross_entropy(*inputs, **kwargs)
    seen["losses"].append([len(seen["draws"]), loss.item()])  # 1: the first pass's steps
    return loss


def loader(self):
    seen["workers"].append(self.num_workers)
    return loader_iter(self)


torch.nn.functional.cross_entropy, DataLoader.__iter__ = loss_of, loader
if os.environ.get("FMNIST_MIRROR"):
    FashionMNIST = torchvision.datasets.FashionMNIST
    FashionMNIST.mirrors = [os.environ["FMNIST_MIRROR"]]
    FashionMNIST.resources = [(name, None) for name, _ in FashionMNIST.resources]
    fetch = torchvision.datasets.mnist.download_and_extract_archive

    def download(url, *args, **kwargs):
        seen["downloads"].append(url.rsplit("/", 1)[-1])
        return fetch(url, *args, **kwargs)

    torchvision.datasets.mnist.download_and_extract_archive = download

if __name__ == "__main__":
    out, script = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        Path(f"{out}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))
