"""ddp_fashionmnist.py: launch paths, real DDP, evaluation counted once, real accuracy, bad input."""
import os
import struct
import sys

import pytest
import torch

from conftest import DEBIAN_FMNIST, ROOT, metrics, python, run, torchrun

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
    """Spawned, also under TORCH_DISTRIBUTED_DEBUG=DETAIL, which crashes DDP on gloo in torch
    2.11-2.14 unless the script leaves the gloo group unwrapped."""
    out = tmp_path / "m.json"
    if launcher == "spawn":
        cmd = python("ddp_fashionmnist.py", "--nprocs", 2, *SMOKE, "--metrics-out", out)
    else:
        cmd = torchrun("ddp_fashionmnist.py", 2, *SMOKE, "--metrics-out", out)
    res = run(cmd, timeout=180, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if launcher == "spawn" else None)
    m = metrics(out)
    assert (m["world_size"], m["backend"], m["device"]) == (2, "gloo", "cpu")
    assert (m["epochs_run"], m["steps"], m["test_samples"]) == (2, 10, 10000)
    assert m["final_loss"] > 0 and 0 <= m["test_accuracy"] <= 1
    printed = [line for line in res.stdout.splitlines() if line.startswith(("epoch", "done"))]
    assert len(printed) == 3 and all(line.endswith("| synthetic data") for line in printed)
    assert res.stdout.splitlines()[0] == ("start | 2 processes | gloo on CPU | SeqNet | synthetic 60000 images | "
                                          "batch 100 x 2 | 5 steps x 2 epochs")  # before the first step


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
    # ...and the weights did move from the script's own initial ones, so the comparison means something
    torch.manual_seed(0)
    init = script().SeqNet(784, 200, 200, 10).state_dict()
    assert (w1["lin1.weight"] - init["lin1.weight"]).abs().max() > 1e-3
    m1, m2 = metrics(tmp_path / "m1.json"), metrics(tmp_path / "m2.json")
    assert m2["final_loss"] == pytest.approx(m1["final_loss"], rel=1e-4)


def test_evaluation_counts_each_image_once(tmp_path):
    """The same weights scored by the script's test() at world size 1 and 3 (10,000 does not
    divide by 3): the same count of correct answers, over exactly 10,000 images."""
    weights = tmp_path / "w.pt"
    torch.manual_seed(1)
    torch.save(script().SeqNet(784, 200, 200, 10).state_dict(), weights)
    for world in (1, 3):
        run(torchrun("tests/score_fashionmnist.py", world, weights, tmp_path / f"s{world}.json", *SMOKE), timeout=180)
    scores = [metrics(tmp_path / f"s{world}.json") for world in (1, 3)]
    assert scores[0] == scores[1] and scores[0]["seen"] == 10000, scores


def script():
    """ddp_fashionmnist.py as a module, to read its own definitions."""
    sys.path.insert(0, str(ROOT))
    import ddp_fashionmnist
    return ddp_fashionmnist


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
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: FashionMNIST is not in {bad} ") and "Not a directory" in lines[0]


def test_truncated_idx_file_is_one_clear_line(tmp_path):
    root = tiny_fmnist(tmp_path / "fm", truncate=7)
    res = run(python("ddp_fashionmnist.py", "--cpu", "--epochs", "1", "--data", root), timeout=120, check=False)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "t10k-labels-idx1-ubyte is unreadable or truncated" in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_folder_missing_some_idx_files_is_one_clear_line(tmp_path):
    root = tiny_fmnist(tmp_path / "fm")
    (root / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte").unlink()
    res = run(python("ddp_fashionmnist.py", "--cpu", "--data", root), timeout=60, check=False)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        f"error: {root} lacks train-labels-idx1-ubyte; add the missing file(s) "
        f"(.gz or not), or delete the folder so a download fills it"]
