"""ddp_resnet.py and dp_resnet.py as a user runs them: CPU, gloo, resnet18 on 32 px synthetic
images, 2 steps an epoch; checkpoints that load into a plain model, resume, and refusals."""

import math
import pickle
import re
import shutil

import pytest
import torch
import torchvision

from conftest import (
    DP,
    ONE_THREAD,
    RESNET,
    ROOT,
    finish,
    last_line,
    metrics,
    python,
    run,
    same_weights,
    start,
)

TIMEOUT = 180


def command(script: str, *flags) -> list:
    if script == "dp_resnet.py":
        return python(script, *DP, *flags)
    return python(script, *RESNET, "--nprocs", 2, *flags)


def check_checkpoints(folder, epochs) -> None:
    """Every epoch_N.pt is there and loads, weights only, into a plain torchvision model."""
    assert sorted(p.name for p in folder.glob("epoch_*")) == sorted(f"epoch_{e}.pt" for e in epochs)
    for e in epochs:
        ckpt = torch.load(folder / f"epoch_{e}.pt", map_location="cpu", weights_only=True)
        assert (
            ckpt.keys() == {"epoch", "model_state_dict", "optimizer_state_dict"}
            and ckpt["epoch"] == e
        )
        torchvision.models.resnet18(num_classes=256).load_state_dict(ckpt["model_state_dict"])
        assert ckpt["optimizer_state_dict"]["state"], "momentum buffers missing"


def test_ddp_run_prints_saves_and_reports(uninterrupted):
    folder, out, err = uninterrupted
    assert err == ""  # no warning to read past (the tutorials' pin_memory on CPU, pretrained=)
    m = metrics(folder / "metrics.json")
    assert {
        k: m[k]
        for k in ("script", "world_size", "backend", "device", "model", "epochs_run", "steps")
    } == {
        "script": "ddp_resnet.py",
        "world_size": 2,
        "backend": "gloo",
        "device": "cpu",
        "model": "ResNet",
        "epochs_run": 3,
        "steps": 2,
    }
    assert math.isfinite(m["final_loss"]) and m["images_per_sec"] > 0
    assert m["checkpoint"] == str(folder / "epoch_3.pt")
    check_checkpoints(folder, [1, 2, 3])
    lines = out.splitlines()
    assert lines[0] == (
        "start | script ddp_resnet.py | world_size 2 | device cpu | backend gloo | model ResNet "
        "| steps 2 | epochs 1-3"
    )
    assert [line.split(" |")[0] for line in lines[1:]] == ["epoch 1/3"] * 3 + ["epoch 2/3"] * 3 + [
        "epoch 3/3"
    ] * 3 + ["done"]
    assert re.fullmatch(
        r"epoch 1/3 \| step 1/2 \| loss \d+\.\d{4} \| \d+ img/s \| \d+\.\d s", lines[1]
    ), lines[1]
    assert re.fullmatch(
        r"epoch 3/3 \| final_loss \S+ \| images_per_sec \S+ \| seconds \S+", lines[9]
    ), lines[9]
    assert (
        lines[10]
        == f"done | epochs_run 3 | final_loss {m['final_loss']:.4g} | checkpoint {folder / 'epoch_3.pt'}"
    )


def test_a_leftover_local_rank_still_checks_and_resumes(uninterrupted, tmp_path):
    """LOCAL_RANK=1 left in the shell, RANK unset: the script spawns its own ranks, so its
    launcher checks the input. Before, it skipped the checks (it asked LOCAL_RANK, not whether
    it spawns): a fresh run into a used folder was not refused, and a bad --data was a rank's
    traceback. --resume goes on from the newest checkpoint and leaves the older ones as they
    were, to the byte."""
    leftover = {**ONE_THREAD, "LOCAL_RANK": "1"}
    for name in ("epoch_1.pt", "epoch_2.pt"):  # as if stopped after epoch 2
        shutil.copy(uninterrupted[0] / name, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    flags = ["--epochs", 3, "--ckpt-dir", tmp_path]
    procs = [  # at once: the two refusals stop before any rank starts
        start(command("ddp_resnet.py", *flags, "--resume"), env=leftover),
        start(command("ddp_resnet.py", *flags), env=leftover),
        start(command("ddp_resnet.py", "--data", tmp_path / "missing"), env=leftover),
    ]
    resumed, fresh, bad_data = (finish(p, TIMEOUT, check=False) for p in procs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.splitlines()[0].endswith(
        f"| steps 2 | resuming from {tmp_path / 'epoch_2.pt'} | epochs 3-3"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.glob("epoch_[12].pt")} == before
    same_weights(uninterrupted[0] / "epoch_3.pt", tmp_path / "epoch_3.pt")
    assert fresh.returncode == 1 and last_line(fresh.stderr).startswith(
        f"error: {tmp_path / 'epoch_2.pt'} exists: add --resume"
    ), fresh.stderr[-3000:]
    assert bad_data.returncode == 1 and last_line(bad_data.stderr).startswith(
        f"error: --data {tmp_path / 'missing'}: [Errno 2]"
    ), bad_data.stderr[-3000:]


OWN_BATCHNORM1D = """def build_model(args, num_classes):
    # a BatchNorm over features: one value per channel in any batch of 1
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.BatchNorm1d(4), torch.nn.Linear(4, num_classes),
    )
"""


def test_a_batch_the_model_cannot_train_on_is_one_line(tmp_path):
    """BatchNorm cannot train on one value per channel: resnet18 at 32 px with 1 image a rank
    (or a DataParallel process) has that in its last block. Before, it was BatchNorm's traceback
    after the ranks had started. The script asks the model rather than a rule: at 224 px 1 image
    trains, and a copy's own model with a BatchNorm over features fails at any size."""
    text = (ROOT / "ddp_resnet.py").read_text()
    own = text[: text.index("def build_model")] + OWN_BATCHNORM1D
    own += text[text.index("\n\n\n", text.index("def build_model")) :]
    (tmp_path / "own.py").write_text(own)
    one = ["--batch-size", 1, "--epochs", 1, "--max-steps", 1]
    wide = ["--cpu", "--arch", "resnet18", "--image-size", 224, *one]
    procs = [  # at once: the refusals stop before any rank starts
        start(command("ddp_resnet.py", *one, "--ckpt-dir", tmp_path / "a")),
        start(command("dp_resnet.py", *one, "--ckpt-dir", tmp_path / "b")),
        start(python(tmp_path / "own.py", *RESNET, *one, "--image-size", 224)),
        start(python("ddp_resnet.py", *wide, "--nprocs", 2, "--ckpt-dir", tmp_path / "c")),
        start(python("dp_resnet.py", *wide, "--ckpt-dir", tmp_path / "d")),
    ]
    results = [finish(p, TIMEOUT, check=False) for p in procs]
    for res in results[:3]:
        assert res.returncode == 1 and "start |" not in res.stdout, res.stderr[-3000:]
        line = last_line(res.stderr)
        assert re.match(r"error: --batch-size 1 .* too few at --image-size (32|224) ", line), line
        assert "Expected more than 1 value per channel when training" in line, line
    for res in results[3:]:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.splitlines()[-1].startswith("done | epochs_run 1")


@pytest.mark.parametrize("script", ["ddp_resnet.py", "dp_resnet.py"])
def test_a_fresh_run_refuses_a_folder_with_checkpoints(script, uninterrupted, tmp_path):
    """The stale-checkpoint defect: a 3-epoch run, then a fresh 1-epoch run with another --lr in
    the same folder left epoch_2 and epoch_3 of the first behind, and a later --resume took them
    for its own. Now the fresh run stops at once and names both ways out."""
    ckpt = tmp_path / "ck"  # a finished 3-epoch run's (DDP's and DataParallel's are alike)
    shutil.copytree(uninterrupted[0], ckpt, ignore=shutil.ignore_patterns("*.json"))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    res = run(
        command(script, "--epochs", 1, "--lr", 0.1, "--ckpt-dir", ckpt),
        timeout=TIMEOUT,
        check=False,
    )
    assert res.returncode == 1
    assert (
        res.stderr
        == f"error: {ckpt / 'epoch_3.pt'} exists: add --resume to go on from it, or use another --ckpt-dir\n"
    )
    assert (
        "start |" not in res.stdout and {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    )
    if script == "dp_resnet.py":
        check_checkpoints(ckpt, [1, 2, 3])
        out = tmp_path / "new" / "m.json"  # a folder that --metrics-out makes
        flags = ["--epochs", 4, "--ckpt-dir", ckpt, "--resume", "--metrics-out", out]
        res = run(command(script, *flags), timeout=TIMEOUT)
        assert res.stdout.splitlines()[0] == (  # the DDP scripts' form: what runs where
            "start | script dp_resnet.py | world_size 1 | device cpu | model ResNet | steps 2 "
            f"| resuming from {ckpt / 'epoch_3.pt'} | epochs 4-4"
        )
        assert (ckpt / "epoch_4.pt").is_file() and metrics(out)["epochs_run"] == 1
        assert res.stderr == ""  # no warning to read past (the tutorial's pretrained=False)
        res = run(command(script, *flags), timeout=TIMEOUT)  # finished: says so, trains nothing
        assert res.stdout.splitlines() == [
            "start | script dp_resnet.py | world_size 1 | device cpu | model ResNet | steps 2 "
            f"| nothing to train: {ckpt / 'epoch_4.pt'} reached --epochs 4",
            "done | epochs_run 0 | checkpoint -",
        ]


class Mkdir:
    """A pickle that would create a folder when loaded without weights_only."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return os.mkdir, (self.path,)


@pytest.mark.parametrize("script", ["ddp_resnet.py", "dp_resnet.py"])
def test_a_bad_checkpoint_on_resume_is_one_line_naming_its_cause(script, uninterrupted, tmp_path):
    """Damaged, another model's, or a pickle that would run code: each refused in one line that
    says which, before any training; the code never runs."""
    good = (uninterrupted[0] / "epoch_1.pt").read_bytes()
    cases = {
        "cut": (good[: len(good) // 2], [], "PytorchStreamReader failed reading zip archive"),
        "other model": (
            good,
            ["--arch", "resnet34"],
            "Error(s) in loading state_dict for ResNet: Missing key(s)",
        ),
        "code": (
            pickle.dumps({"model_state_dict": Mkdir(tmp_path / "pwned")}, protocol=2),
            [],
            "Weights only load failed",
        ),
    }
    procs = {}  # all at once: each stops before training, in its own folder
    for name, (data, flags, _) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "epoch_1.pt").write_bytes(data)
        procs[name] = start(
            command(script, "--epochs", 2, "--ckpt-dir", folder, "--resume", *flags)
        )
    for name, (_, _, cause) in cases.items():
        folder, res = tmp_path / name.replace(" ", "_"), finish(procs[name], TIMEOUT, check=False)
        assert res.returncode == 1, name
        assert last_line(res.stderr).startswith(
            f"error: cannot resume from {folder / 'epoch_1.pt'}: "
        ), name
        assert cause in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
        assert "epoch 2/2" not in res.stdout and not (folder / "epoch_2.pt").exists()
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("script", ["ddp_resnet.py", "dp_resnet.py"])
def test_bad_input_is_one_line_and_nothing_starts(script, tmp_path, read_only):
    folder, why = read_only
    (tmp_path / "file").write_text("a file where a folder should be")
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_images" / "only_class").mkdir(parents=True)
    cases = [
        (["--epochs", 0], 2, "argument --epochs: expected a whole number above 0, got '0'"),
        (["--arch", "resnet5"], 2, "argument --arch: invalid choice: 'resnet5'"),
        (
            ["--data", tmp_path / "missing"],
            1,
            f"error: --data {tmp_path / 'missing'}: [Errno 2] No such file or directory: '{tmp_path / 'missing'}'",
        ),
        (
            ["--data", tmp_path / "empty"],
            1,
            f"error: --data {tmp_path / 'empty'}: Couldn't find any class folder in {tmp_path / 'empty'}.",
        ),
        (  # torchvision's own words name the class, not the folder: the flag and path come first
            ["--data", tmp_path / "no_images"],
            1,
            f"error: --data {tmp_path / 'no_images'}: Found no valid file for the classes only_class.",
        ),
        (
            ["--ckpt-dir", tmp_path / "file"],
            1,
            f"error: cannot make {tmp_path / 'file'}: File exists"
            if script == "dp_resnet.py"
            else f"error: cannot make --ckpt-dir: [Errno 17] File exists: '{tmp_path / 'file'}'",
        ),
        (  # found before training, not when rank 0 writes it at the end
            ["--metrics-out", tmp_path / "file" / "m.json"],
            1,
            f"error: cannot make {tmp_path / 'file'}: File exists"
            if script == "dp_resnet.py"
            else f"error: [Errno 17] File exists: '{tmp_path / 'file'}'",
        ),
        (  # a folder that exists, where the file cannot be written
            ["--metrics-out", folder / "m.json"],
            1,
            f"error: cannot make {folder / 'm.json'}: {why.split('] ')[1]}"
            if script == "dp_resnet.py"
            else f"error: {why}: '{folder / 'm.json'}'",
        ),
        (["--batch-size", 13000], 1, "error: 12800 images, too few for --batch-size 13000"),
        (["--workers", -1], 1, "error: --workers -1: use 0 or more"),  # was a rank's traceback
    ]
    if script == "ddp_resnet.py":  # one batch fits, one a rank (2 ranks) does not
        cases.append(
            (
                ["--batch-size", 6401],
                1,
                "error: 12800 images, too few for --batch-size 6401 x 2 processes",
            )
        )
    procs = [
        start(command(script, "--ckpt-dir", tmp_path / "ck", *f)) for f, _, _ in cases
    ]  # at once, and a fresh run in a read-only current folder: it cannot make its --ckpt-dir
    procs.append(start(command(script), cwd=folder))
    cases.append(
        (
            ["(in a read-only folder)"],
            1,
            f"error: cannot make model_checkpoints: {why.split('] ')[1]}"
            if script == "dp_resnet.py"
            else f"error: cannot make --ckpt-dir: {why}: 'model_checkpoints'",
        )
    )
    for proc, (flags, code, line) in zip(procs, cases, strict=True):
        res = finish(proc, TIMEOUT, check=False)
        assert res.returncode == code, (flags, res.stderr)
        assert line in last_line(res.stderr), (flags, res.stderr)
        assert "start |" not in res.stdout
