"""ddp_fashionmnist.py: launch paths, real DDP, evaluation counted once, real accuracy, bad input."""
import os
import struct

import pytest
import torch

from conftest import DEBIAN_FMNIST, metrics, python, run, torchrun

SMOKE = ["--cpu", "--synthetic", "--epochs", "2", "--max-steps", "5", "--timeout", "60"]


def write_idx(path, data: torch.Tensor, truncate: int = 0) -> None:
    """Write a tensor in the IDX format (uint8), optionally dropping the last bytes."""
    header = struct.pack(">I", 0x0800 | data.dim()) + struct.pack(f">{data.dim()}I", *data.shape)
    raw = header + data.to(torch.uint8).numpy().tobytes()
    path.write_bytes(raw[:len(raw) - truncate])


def tiny_fmnist(root, truncate: int = 0):
    """A torchvision-style root (FashionMNIST/raw, uncompressed) with a few hundred images."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(1)
    for split, n in (("train", 400), ("t10k", 101)):
        write_idx(raw / f"{split}-images-idx3-ubyte", torch.randint(0, 256, (n, 28, 28), generator=g))
        write_idx(raw / f"{split}-labels-idx1-ubyte", torch.randint(0, 10, (n,), generator=g),
                  truncate=truncate if split == "t10k" else 0)
    return root


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_smoke_both_launchers(tmp_path, launcher):
    out = tmp_path / "m.json"
    if launcher == "spawn":
        cmd = python("ddp_fashionmnist.py", "--nprocs", 2, *SMOKE, "--metrics-out", out)
    else:
        cmd = torchrun("ddp_fashionmnist.py", 2, *SMOKE, "--metrics-out", out)
    res = run(cmd, timeout=180)
    m = metrics(out)
    assert (m["world_size"], m["backend"], m["device"]) == (2, "gloo", "cpu")
    assert (m["epochs_run"], m["steps"], m["test_samples"]) == (2, 10, 10000)
    assert m["final_loss"] > 0 and 0 <= m["test_accuracy"] <= 1
    printed = [line for line in res.stdout.splitlines() if line.startswith(("epoch", "done"))]
    assert len(printed) == 3 and all(line.endswith("| synthetic data") for line in printed)


def test_ddp_matches_one_process_with_the_global_batch(tmp_path):
    """2 ranks x batch 100 and 1 rank x batch 200 see the same samples per step: same weights."""
    common = ["--cpu", "--synthetic", "--epochs", "2", "--max-steps", "8", "--timeout", "60"]
    for world, batch in ((2, 100), (1, 200)):
        run(python("ddp_fashionmnist.py", *common, "--nprocs", world, "--batch-size", batch,
                   "--save-model", tmp_path / f"w{world}.pt", "--metrics-out", tmp_path / f"m{world}.json"),
            timeout=180)
    w1, w2 = (torch.load(tmp_path / f"w{w}.pt", weights_only=True) for w in (1, 2))
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)
    # ...and the weights did move, so the comparison means something
    init = torch.load(tmp_path / "w1.pt", weights_only=True)
    run(python("ddp_fashionmnist.py", *common, "--nprocs", 1, "--eval-only",
               "--save-model", tmp_path / "w0.pt"), timeout=180)
    assert not torch.equal(torch.load(tmp_path / "w0.pt", weights_only=True)["lin1.weight"], init["lin1.weight"])
    m1, m2 = metrics(tmp_path / "m1.json"), metrics(tmp_path / "m2.json")
    assert m2["final_loss"] == pytest.approx(m1["final_loss"], rel=1e-4)


def test_evaluation_counts_each_image_once(tmp_path):
    """Same weights, world size 1 and 3 (10,000 does not divide by 3): the same count of correct
    answers, over exactly 10,000 images."""
    weights = tmp_path / "w.pt"
    run(python("ddp_fashionmnist.py", *SMOKE, "--nprocs", 1, "--eval-only", "--save-model", weights,
               "--metrics-out", tmp_path / "m1.json"), timeout=180)
    run(python("ddp_fashionmnist.py", *SMOKE, "--nprocs", 3, "--eval-only", "--load-model", weights,
               "--metrics-out", tmp_path / "m3.json"), timeout=180)
    results = [metrics(tmp_path / "m1.json"), metrics(tmp_path / "m3.json")]
    assert [r["test_samples"] for r in results] == [10000, 10000]
    assert results[0]["test_correct"] == results[1]["test_correct"]


def test_uncompressed_torchvision_layout_trains(tmp_path):
    root = tiny_fmnist(tmp_path / "fm")
    out = tmp_path / "m.json"
    run(python("ddp_fashionmnist.py", "--cpu", "--nprocs", 3, "--epochs", "1", "--data", root,
               "--metrics-out", out), timeout=180)
    m = metrics(out)
    assert m["test_samples"] == 101 and m["steps"] == 2  # 400 images / 3 ranks / batch 100


def test_real_fashionmnist_accuracy(tmp_path):
    """The tutorial's defaults, 2 gloo processes, Debian's FashionMNIST: at least 0.80."""
    if not (DEBIAN_FMNIST / "t10k-labels-idx1-ubyte.gz").is_file():
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's dataset-fashion-mnist")
        pytest.skip("dataset-fashion-mnist is not installed")
    out = tmp_path / "m.json"
    run(python("ddp_fashionmnist.py", "--cpu", "--nprocs", 2, "--data", DEBIAN_FMNIST,
               "--metrics-out", out), timeout=600)
    m = metrics(out)
    assert (m["epochs_run"], m["steps"], m["test_samples"]) == (10, 3000, 10000)
    assert m["test_accuracy"] >= 0.80, m


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "0"], "error: --batch-size must be positive, got 0"),
    (["--epochs", "-1"], "error: --epochs must be positive, got -1"),
    (["--lr", "0"], "error: --lr must be positive, got 0.0"),
])
def test_bad_flags_are_one_clear_line(flags, message):
    res = run(python("ddp_fashionmnist.py", "--cpu", *flags), timeout=60, check=False)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [message]


def test_data_that_is_a_file_is_one_clear_line(tmp_path):
    bad = tmp_path / "not_a_folder"
    bad.write_text("x")
    res = run(python("ddp_fashionmnist.py", "--cpu", "--data", bad), timeout=60, check=False)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [f"error: --data {bad} is not a folder"]


def test_truncated_idx_file_is_one_clear_line(tmp_path):
    root = tiny_fmnist(tmp_path / "fm", truncate=7)
    res = run(python("ddp_fashionmnist.py", "--cpu", "--epochs", "1", "--data", root), timeout=120, check=False)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert lines and all("t10k-labels-idx1-ubyte is truncated" in line for line in lines), res.stderr
    assert "Traceback" not in res.stderr


def test_folder_missing_some_idx_files_is_one_clear_line(tmp_path):
    root = tiny_fmnist(tmp_path / "fm")
    (root / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte").unlink()
    res = run(python("ddp_fashionmnist.py", "--cpu", "--data", root), timeout=60, check=False)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        f"error: {root / 'FashionMNIST' / 'raw'} lacks train-labels-idx1-ubyte; add the missing file(s) "
        f"(.gz or not), or delete the folder so a download fills it"]
