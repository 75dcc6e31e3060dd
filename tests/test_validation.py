"""ddp_resnet.py --val-data: top-1 on a held-out ImageFolder after every epoch, each image
counted once at any world size. CPU, gloo, launched as a user would."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import DEBIAN_FMNIST, ROOT, metrics, python, run

FLAGS = ["--cpu", "--arch", "resnet18", "--image-size", 32, "--batch-size", 4, "--timeout", 60]
SUMMARY = re.compile(r"^epoch (\d+)/5 \| loss \d+\.\d{4} \| val_accuracy (\d\.\d{4}) \(31 images\) \| "
                     r"(?:\d+|-) img/s \| \d+\.\d s$", re.M)


def dark_and_bright(root, dark: int, bright: int, seed: int) -> None:
    """Two classes of 40x40 noise PNGs, dark (values below 80) and bright (above 175): a model
    can learn them in a few steps."""
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    for name, count, low in (("bright", bright, 176), ("dark", dark, 0)):
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = torch.randint(low, low + 80, (40, 40, 3), dtype=torch.uint8, generator=g)
            Image.fromarray(pixels.numpy()).save(root / name / f"{i}.png")


def test_validation_counts_each_image_once_at_any_world_size(tmp_path):
    """31 validation images on 3 ranks: every one scored once; the last checkpoint scored again
    by a single process (--resume past --epochs: nothing trained) gives the same count."""
    train, val, ckpt = tmp_path / "train", tmp_path / "val", tmp_path / "ckpt"
    dark_and_bright(train, 96, 96, seed=0)  # 16 steps an epoch: BatchNorm's running statistics,
    dark_and_bright(val, 15, 16, seed=1)  # which eval mode uses, settle within a few epochs
    flags = [*FLAGS, "--data", train, "--val-data", val, "--epochs", 5, "--lr", 0.003, "--ckpt-dir", ckpt]
    res = run(python("ddp_resnet.py", *flags, "--nprocs", 3, "--metrics-out", tmp_path / "3.json"), timeout=240)
    assert [int(e) for e, _ in SUMMARY.findall(res.stdout)] == [1, 2, 3, 4, 5], res.stdout
    trained = metrics(tmp_path / "3.json")
    assert trained["val_samples"] == 31 and trained["world_size"] == 3
    assert trained["val_accuracy"] == trained["val_correct"] / 31 >= 0.9
    assert f"val_accuracy {trained['val_accuracy']:.4f} (31 images)" in res.stdout.splitlines()[-1]  # done line
    res = run(python("ddp_resnet.py", *flags, "--nprocs", 1, "--resume", "--metrics-out", tmp_path / "1.json"),
              timeout=180)
    assert f"--resume: {ckpt / 'epoch_5.pt'} already reached --epochs 5" in res.stdout
    scored = metrics(tmp_path / "1.json")
    assert (scored["world_size"], scored["epochs_run"], scored["steps"]) == (1, 0, 0)
    assert (scored["val_correct"], scored["val_samples"]) == (trained["val_correct"], 31)
    assert scored["checkpoint"] == str(ckpt / "epoch_5.pt")


@pytest.mark.parametrize("case", ["other classes", "no --data"])
def test_val_data_needs_the_same_classes_as_data(case, tmp_path):
    train, val = tmp_path / "train", tmp_path / "val"
    dark_and_bright(train, 2, 2, seed=0)
    dark_and_bright(val, 2, 2, seed=1)
    if case == "other classes":
        (val / "dark").rename(val / "grey")
    flags = ["--data", train] if case == "other classes" else []
    res = run(python("ddp_resnet.py", *FLAGS, *flags, "--val-data", val, "--ckpt-dir", tmp_path / "ckpt"),
              timeout=60, check=False)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        f"error: --val-data {val} and --data {train} must hold the same class folders" if case == "other classes"
        else "error: --val-data needs --data, with the same class folders"]
    assert not (tmp_path / "ckpt").exists()  # refused before anything started


def test_fashionmnist_folder_helper(tmp_path):
    """The README's real-data run starts from this helper: class folders 0..9 of PNGs."""
    if not DEBIAN_FMNIST.is_dir():
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's dataset-fashion-mnist")
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    subprocess.run([sys.executable, ROOT / "tests" / "fashionmnist_folder.py", DEBIAN_FMNIST, tmp_path, "50", "20"],
                   check=True, timeout=120)
    for part, count in (("train", 50), ("val", 20)):
        assert sorted(p.name for p in (tmp_path / part).iterdir()) == [str(c) for c in range(10)]
        assert len(list((tmp_path / part).glob("*/*.png"))) == count
