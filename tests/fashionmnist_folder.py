"""Write FashionMNIST as two ImageFolders of PNGs, OUT/train and OUT/val, one folder per class
(0..9): real images for ddp_resnet.py --data OUT/train --val-data OUT/val.

    python tests/fashionmnist_folder.py /usr/share/datasets/fashion-mnist OUT [TRAIN [VAL]]

TRAIN and VAL images (default: all 60,000 and 10,000) come from the training and the test
files, the first ones of each."""
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_fashionmnist import idx_files, read_idx  # noqa: E402  the script's IDX reader


def write(files: dict, part: str, folder: Path, count: int) -> None:
    images, labels = read_idx(files[f"{part}-images-idx3-ubyte"]), read_idx(files[f"{part}-labels-idx1-ubyte"])
    for i, (image, label) in enumerate(zip(images[:count], labels[:count].tolist())):
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image.numpy()).save(folder / str(label) / f"{i}.png")


if __name__ == "__main__":
    root, out, *counts = sys.argv[1:]
    train, val = [int(c) for c in counts] + [60000, 10000][len(counts):]
    files = idx_files(Path(root))
    write(files, "train", Path(out) / "train", train)
    write(files, "t10k", Path(out) / "val", val)
