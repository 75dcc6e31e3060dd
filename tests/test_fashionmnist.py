"""ddp_fashionmnist.py: a spawned copy, the test set counted once, the loss per image, DDP on two
ranks equal to one process, and bad data (torchrun and real accuracy: test_fixes.py)."""

import gzip
import shutil

import pytest

from conftest import (
    ONE_THREAD,
    ROOT,
    debian_fmnist,
    finish,
    finish_all,
    fm_report,
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
    DistributedSampler pads the shares); it reports its own name, and no warning. (3 ranks:
    test_multinode.py.) At --lr 0 the model never changes, so the epoch's mean loss is the same
    for any batch size: on 1 rank in batches of 29999, 29999 and 2 images, as on 2 ranks in
    batches of 100. Before, it was the mean of the batches' means: the batch of 2 weighed as
    much as a full one."""
    copy = shutil.copy(ROOT / "ddp_fashionmnist.py", tmp_path / "my_fashionmnist.py")
    outs = {size: tmp_path / f"{size}.json" for size in (100, 29999)}
    flags = [*SMOKE, "--lr", 0]
    procs = [  # at once; 100 is the default batch size
        start(python(copy, *flags, "--metrics-out", outs[100])),
        start(
            python(copy, *flags, "--batch-size", 29999, "--nprocs", 1, "--metrics-out", outs[29999])
        ),
    ]
    res = finish_all(procs, timeout=180)[0]
    m = metrics(outs[100])
    fm_report(res, m, "my_fashionmnist.py", epochs=1)
    assert res.stderr == ""  # no warning to read past (the tutorial's pin_memory on a CPU)
    assert metrics(outs[29999])["final_loss"] == pytest.approx(m["final_loss"], rel=1e-4)


@pytest.mark.learned  # two trainings on the real data, compared with each other
def test_ddp_on_two_ranks_equals_one_process_on_their_global_batch(tmp_path):
    """DDP averages the ranks' gradients: 2 ranks of batch 50 train on the same global batches
    as 1 process of batch 100 (DistributedSampler deals one shuffled order out in turn), so both
    end with the same loss and score the same test images right. At lr 0.001 the two agree to
    7 digits; at the tutorial's 0.01 the training is chaotic (one process on 1 or 2 threads
    already ends 0.70 or 0.78), so the test uses 0.001."""
    root = debian_root(tmp_path / "data")
    flags = ["--cpu", "--data", root, "--epochs", 1, "--lr", 0.001, "--timeout", 60]
    outs = {n: tmp_path / f"{n}.json" for n in (1, 2)}
    procs = [
        start(
            python(
                "ddp_fashionmnist.py",
                *flags,
                "--nprocs",
                n,
                "--batch-size",
                100 // n,
                "--metrics-out",
                out,
            ),
            env=ONE_THREAD,
        )
        for n, out in outs.items()
    ]
    finish_all(procs, timeout=180)
    one, two = metrics(outs[1]), metrics(outs[2])
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-4)
    assert abs(two["test_correct"] - one["test_correct"]) <= 10, (one, two)
    assert one["test_samples"] == two["test_samples"] == 10000


def test_bad_data_fails_before_training_and_names_the_cause(tmp_path):
    """A damaged file: torchvision's own error, from the rank that reads it first, and no
    start line. An empty flag, or a learning rate of inf: argparse's one line."""
    root = debian_root(tmp_path / "cut")
    raw = root / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte"
    raw.write_bytes(raw.read_bytes()[:-1000])  # truncated
    cases = [  # at once: each stops before training
        (["--data", root], 1, "shape '[10000, 28, 28]' is invalid for input of size"),
        # `--data "$DATA"`, DATA unset: once, a download into the current folder
        (["--data", ""], 2, "ddp_fashionmnist.py: error: argument --data: invalid nonempty"),
        # once, Adam took it, every step trained to nan, and the run exited 0
        (["--lr", "inf"], 2, "ddp_fashionmnist.py: error: argument --lr: invalid learning_rate"),
    ]
    procs = [start(python("ddp_fashionmnist.py", "--cpu", *f)) for f, _, _ in cases]
    for proc, (_, code, cause) in zip(procs, cases, strict=True):
        res = finish(proc, timeout=120, check=False)
        assert res.returncode == code and cause in res.stderr, res.stderr[-3000:]
        assert "start |" not in res.stdout
