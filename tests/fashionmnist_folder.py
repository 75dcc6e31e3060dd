"""Write FashionMNIST as two ImageFolders of PNGs, OUT/train and OUT/val, one folder per class
(0..9): real images for ddp_resnet.py --data OUT/train --val-data OUT/val.

    python tests/fashionmnist_folder.py ROOT OUT [TRAIN [VAL]]

ROOT is a torchvision root: ROOT/FashionMNIST/raw holds the four unzipped IDX files. TRAIN and
VAL images (default: all 60,000 and 10,000) are the first ones of the training and test sets."""

import sys
from pathlib import Path

from torchvision.datasets import FashionMNIST


def write(dataset: FashionMNIST, folder: Path, count: int) -> None:
    for i in range(min(count, len(dataset))):
        image, label = dataset[i]  # a PIL image
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        image.save(folder / str(label) / f"{i}.png")


if __name__ == "__main__":
    root, out, *counts = sys.argv[1:]
    train, val = [int(c) for c in counts] + [60000, 10000][len(counts) :]
    write(FashionMNIST(root, train=True), Path(out) / "train", train)
    write(FashionMNIST(root, train=False), Path(out) / "val", val)
