"""ddp_fashionmnist.py: a spawned copy, the test set counted once, the loss per image, and bad data
in one line (torchrun and real accuracy: test_fixes.py)."""

import gzip
import shutil

import pytest

from conftest import (
    ROOT,
    debian_fmnist,
    finish,
    finish_all,
    fm_report,
    last_line,
    metrics,
    python,
    start,
)

SMOKE = ["--cpu", "--synthetic", "--epochs", 1, "--timeout", 60]


def debian_root(root):
    """Debian's four .gz files, gunzipped where torchvision looks: ROOT/FashionMNIST/raw."""
    debian = debian_fmnist()
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in debian.glob("*-ubyte.gz"):
        with gzip.open(gz) as src, open(raw / gz.stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return root


def test_each_test_image_once_and_the_loss_per_image(tmp_path):
    """A user's copy, spawned: 10,000 test images on 2 ranks, each scored once (a
    DistributedSampler pads the shares); it reports its own name, and no warning. (3 ranks
    under torchrun: test_fixes.py.) At --lr 0 the model never changes, so the epoch's mean loss
    is the same for any batch size. Before, it was the mean of the batches' means: a short last
    batch of 1 image (batch 29999 of a rank's 30000) weighed as much as the full one, and the
    loss moved by 20%."""
    copy = shutil.copy(ROOT / "ddp_fashionmnist.py", tmp_path / "my_fashionmnist.py")
    outs = {size: tmp_path / f"{size}.json" for size in (100, 29999)}
    procs = [  # at once; 100 is the default batch size
        start(python(copy, *SMOKE, "--lr", 0, "--batch-size", size, "--metrics-out", out))
        for size, out in outs.items()
    ]
    res = finish_all(procs, timeout=180)[0]
    m = metrics(outs[100])
    fm_report(res, m, "my_fashionmnist.py", epochs=1)
    assert res.stderr == ""  # no warning to read past (the tutorial's pin_memory on a CPU)
    assert metrics(outs[29999])["final_loss"] == pytest.approx(m["final_loss"], rel=1e-4)


def test_bad_data_is_one_line_before_any_rank_starts(tmp_path):
    root = debian_root(tmp_path / "cut")
    raw = root / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte"
    raw.write_bytes(raw.read_bytes()[:-1000])  # truncated
    (tmp_path / "file").write_text("not a folder")
    # A LOCAL_RANK left in the shell, RANK unset (the second case): the launcher still spawns
    # the ranks, so it still reads (or downloads) the data first. Before, it left that to a
    # torchrun process of LOCAL_RANK 0 that did not exist, and each rank failed with a traceback.
    cases = [  # all at once: each stops before any rank starts
        (["--data", root], {}, 1, f"error: FashionMNIST in {root}: "),
        (
            ["--data", tmp_path / "file"],
            {"LOCAL_RANK": "1"},
            1,
            f"error: FashionMNIST in {tmp_path / 'file'}: ",
        ),
        (["--epochs", 0], {}, 2, "ddp_fashionmnist.py: error: argument --epochs: expected a whole"),
    ]
    procs = [start(python("ddp_fashionmnist.py", "--cpu", *f), env=e) for f, e, _, _ in cases]
    for proc, (_, _, code, line) in zip(procs, cases, strict=True):
        res = finish(proc, timeout=120, check=False)
        assert res.returncode == code and last_line(res.stderr).startswith(line), res.stderr
        assert "start |" not in res.stdout
