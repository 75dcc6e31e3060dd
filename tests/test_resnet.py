"""dp_resnet.py and ddp_resnet.py, launched as a user would: CPU, gloo, 2 processes, resnet18 on
32 px synthetic images, 2 steps an epoch, every run under a hard timeout."""
import hashlib
import math
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
import torchvision

from conftest import ONE_THREAD, RESNET, metrics, python, run, same_weights, torchrun

BASE = ["--arch", "resnet18", "--image-size", 32, "--batch-size", 4, "--max-steps", 2, "--synthetic-size", 32, "--cpu"]
SMALL = [*BASE, "--num-classes", 10]  # dp_resnet.py: no --timeout
DDP = RESNET  # SMALL and --timeout 60
SPAWN = [*DDP, "--nprocs", 2]
TIMEOUT = 180
PROGRESS = re.compile(r"^epoch (\d+)/(\d+) \| step \d+/\d+ \| loss \d+\.\d{4} \| (\d+|-) img/s(?: \| eta \S+)?$", re.M)


def ckpt_args(folder) -> list:
    return ["--ckpt-dir", folder, "--metrics-out", folder / "metrics.json"]


def load(file) -> dict:
    return torch.load(file, map_location="cpu", weights_only=True)


def check_checkpoints(folder, epochs, num_classes: int = 10) -> None:
    """Every epoch_N.pt is there and loads, with weights_only=True, into a plain torchvision model."""
    assert sorted(p.name for p in folder.glob("epoch_*.pt")) == sorted(f"epoch_{e}.pt" for e in epochs)
    for e in epochs:
        ckpt = load(folder / f"epoch_{e}.pt")
        assert ckpt["epoch"] == e and ckpt["arch"] == "resnet18" and ckpt["num_classes"] == num_classes
        torchvision.models.resnet18(num_classes=num_classes).load_state_dict(ckpt["model_state_dict"])
        assert ckpt["optimizer_state_dict"]["state"], "momentum buffers missing"
        sha = hashlib.sha256((folder / f"epoch_{e}.pt").read_bytes()).hexdigest()
        assert (folder / f"epoch_{e}.pt.sha256").read_text() == f"{sha}  epoch_{e}.pt\n"  # sha256sum -c format


def check_ddp_run(folder, out: str, epochs: int) -> dict:
    m = metrics(folder / "metrics.json")
    assert (m["script"], m["world_size"], m["backend"], m["device"]) == ("ddp_resnet.py", 2, "gloo", "cpu")
    assert m["epochs_run"] == epochs and m["steps"] == 2 * epochs and m["resumed_from"] is None
    assert math.isfinite(m["final_loss"]) and m["max_memory_gib"] is None
    assert m["checkpoint"] == str(folder / f"epoch_{epochs}.pt")
    check_checkpoints(folder, range(1, epochs + 1))
    assert sorted({int(e) for e, _, _ in PROGRESS.findall(out)}) == list(range(1, epochs + 1))
    assert re.search(rf"^done \| epochs {epochs} \| final_loss \d+\.\d{{4}} \| (\d+|-) img/s \| checkpoint \S+epoch_{epochs}\.pt$", out, re.M)
    return m


def test_ddp_spawned_checkpoints_load(uninterrupted):
    folder, out = uninterrupted
    assert f"--resume: no checkpoint in {folder}, starting fresh" in out
    lines = out.splitlines()  # rank 0's start line comes before the first step
    assert lines[1] == (f"start | 2 processes | gloo on CPU | resnet18 32px | synthetic 32 images | batch 4 x 2 | "
                        f"2 steps x 4 epochs | ckpt {folder}") and lines[2].startswith("epoch 1/4 | step ")
    check_ddp_run(folder, out, epochs=4)


def test_ddp_under_torchrun_matches_spawn(uninterrupted, tmp_path):
    """torchrun and mp.spawn, same flags: the same checkpoints, to the bit."""
    result = run(torchrun("ddp_resnet.py", 2, *DDP, "--epochs", 2, "--warmup-steps", 1, "--log-every", 1,
                          *ckpt_args(tmp_path)), timeout=TIMEOUT, env=ONE_THREAD)
    m = check_ddp_run(tmp_path, result.stdout, epochs=2)
    assert m["images_per_sec"] > 0  # step 2 of each epoch is timed
    same_weights(uninterrupted[0] / "epoch_2.pt", tmp_path / "epoch_2.pt")


def test_ddp_resume_matches_uninterrupted_run(uninterrupted, tmp_path):
    """The first two epochs' checkpoints, then --resume to 4: exactly the uninterrupted weights."""
    full, _ = uninterrupted
    for name in ("epoch_1.pt", "epoch_1.pt.sha256", "epoch_2.pt", "epoch_2.pt.sha256"):
        shutil.copy(full / name, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("epoch_*.pt")}
    result = run(python("ddp_resnet.py", *SPAWN, "--epochs", 4, "--resume", *ckpt_args(tmp_path)), timeout=TIMEOUT,
                 env=ONE_THREAD)
    assert f"--resume: continuing after {tmp_path / 'epoch_2.pt'}" in result.stdout
    assert f"2 steps x 4 epochs | ckpt {tmp_path} | resumed from epoch 2" in result.stdout
    assert {int(e) for e, _, _ in PROGRESS.findall(result.stdout)} == {3, 4}  # finished epochs not redone
    assert {p.name: p.read_bytes() for p in tmp_path.glob("epoch_[12].pt")} == before
    m = metrics(tmp_path / "metrics.json")
    assert (m["resumed_from"], m["epochs_run"], m["steps"]) == (2, 2, 4)
    check_checkpoints(tmp_path, range(1, 5))
    same_weights(full / "epoch_4.pt", tmp_path / "epoch_4.pt")


def test_dp_on_cpu_and_resume(tmp_path):
    """Two epochs, and epoch 1's checkpoint resumed to 2: the same weights (with --amp
    --channels-last, so those paths run too)."""
    a, b = tmp_path / "a", tmp_path / "b"
    flags = [*SMALL, "--amp", "--channels-last"]
    result = run(python("dp_resnet.py", *flags, "--epochs", 2, *ckpt_args(a)), timeout=TIMEOUT)
    assert "--cpu: the plain model on CPU" in result.stdout
    assert result.stdout.splitlines()[1] == (f"start | 1 process | CPU, no DataParallel | resnet18 32px | synthetic "
                                             f"32 images | batch 4 | 2 steps x 2 epochs | ckpt {a}")
    m = metrics(a / "metrics.json")
    assert (m["script"], m["world_size"], m["backend"], m["device"]) == ("dp_resnet.py", 1, "none", "cpu")
    assert (m["epochs_run"], m["steps"], m["resumed_from"]) == (2, 4, None) and math.isfinite(m["final_loss"])
    assert re.search(r"^done \| epochs 2 \| .* \| checkpoint \S+epoch_2\.pt$", result.stdout, re.M)
    check_checkpoints(a, [1, 2])
    b.mkdir()
    shutil.copy(a / "epoch_1.pt", b)  # and no epoch_1.pt.sha256: a copy made by hand loads too
    result = run(python("dp_resnet.py", *flags, "--epochs", 2, "--resume", *ckpt_args(b)), timeout=TIMEOUT)
    assert metrics(b / "metrics.json")["resumed_from"] == 1
    assert {int(e) for e, _, _ in PROGRESS.findall(result.stdout)} == {2}
    same_weights(a / "epoch_2.pt", b / "epoch_2.pt")


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    """SIGKILL the whole job the moment rank 0 starts writing a checkpoint after epoch_1.pt: every
    epoch_N.pt left must be whole, and --resume must continue from the newest of them (the lock
    died with the job) and remove the temporary file."""
    for attempt in range(3):
        folder = tmp_path / f"try{attempt}"
        folder.mkdir()
        with open(folder / "out.txt", "w") as log:
            proc = subprocess.Popen(python("ddp_resnet.py", *SPAWN, "--epochs", 50, "--max-steps", 1, "--ckpt-dir", folder),
                                    cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                deadline, seen = time.monotonic() + TIMEOUT, None
                while time.monotonic() < deadline and proc.poll() is None:
                    names = set(os.listdir(folder)) - {"out.txt"}
                    if "epoch_1.pt" in names and any(re.match(r"epoch_\d+\.pt\.tmp", n) for n in names):
                        os.killpg(proc.pid, signal.SIGKILL)
                        seen = names
                        break
                    time.sleep(0.001)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        assert seen, f"no second save seen before exit or timeout:\n{(folder / 'out.txt').read_text()[-3000:]}"
        files = [p for p in folder.iterdir() if p.name != "out.txt"]
        whole = sorted(p.name for p in files if re.fullmatch(r"epoch_\d+\.pt", p.name))
        for name in whole:
            try:
                torchvision.models.resnet18(num_classes=10).load_state_dict(load(folder / name)["model_state_dict"])
            except Exception as e:
                pytest.fail(f"{name} is half-written after the kill: {type(e).__name__}: {e}")
        if any(".tmp" in p.name for p in files):  # a temporary file is left: the kill landed mid-save
            break
    else:
        pytest.fail("the kill never landed while a checkpoint was being written")
    assert "epoch_1.pt" in whole  # the checkpoint before the interrupted save survives
    newest = max(int(n[6:-3]) for n in whole)
    result = run(python("ddp_resnet.py", *SPAWN, "--epochs", newest + 1, "--resume", *ckpt_args(folder)), timeout=TIMEOUT)
    assert metrics(folder / "metrics.json")["resumed_from"] == newest
    assert f"continuing after {folder / f'epoch_{newest}.pt'}" in result.stdout
    assert not [p.name for p in folder.iterdir() if ".tmp" in p.name]  # the killed save's: removed


def write_image_folder(root, classes=3, per_class=6):
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = torch.randint(0, 256, (40, 48, 3), dtype=torch.uint8, generator=g).numpy()
            Image.fromarray(pixels).save(root / f"class_{c}" / f"{i}.png")


def test_dp_image_folder_trains(tmp_path):
    """An ImageFolder of PNGs; ddp_resnet.py's is in test_faults.py (uneven shares). 9 images
    in batches of 4: the last batch of 1, which BatchNorm cannot train on, is dropped."""
    write_image_folder(tmp_path / "data", per_class=3)
    run(python("dp_resnet.py", *BASE, "--max-steps", 3, "--data", tmp_path / "data", "--epochs", 2,
               *ckpt_args(tmp_path)), timeout=TIMEOUT)
    m = metrics(tmp_path / "metrics.json")
    assert m["epochs_run"] == 2 and m["steps"] == 4 and math.isfinite(m["final_loss"])
    check_checkpoints(tmp_path, [1, 2], num_classes=3)  # --num-classes follows the ImageFolder


def check_user_error(result, *words) -> str:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    for w in words:
        assert str(w) in lines[0]
    return lines[0]


@pytest.mark.parametrize("script,flags,words", [
    ("ddp_resnet.py", ["--batch-size", 0], ["--batch-size"]),  # more of the same check: test_fashionmnist.py
    ("dp_resnet.py", ["--lr", 0], ["--lr"]),  # dp_resnet.py's own copy of it
    ("ddp_resnet.py", ["--workers", -1], ["--workers"]),
    ("ddp_resnet.py", ["--data", "no/such/folder"], ["no/such/folder"]),
    ("dp_resnet.py", ["--data", "EMPTY"], ["class_0"]),
    ("dp_resnet.py", ["--gpus", 99], ["--gpus 99"]),
    ("dp_resnet.py", ["--synthetic-size", 3], ["--batch-size"]),
    ("ddp_resnet.py", ["--metrics-out", "AFILE/m.json"], ["AFILE/m.json", "File exists"]),  # found
    ("dp_resnet.py", ["--metrics-out", "AFILE/m.json"], ["AFILE/m.json", "File exists"]),  # before training
])
def test_bad_flags_give_one_error_line(script, flags, words, tmp_path):
    (tmp_path / "empty" / "class_0").mkdir(parents=True)
    (tmp_path / "empty" / "class_0" / "notes.txt").write_text("not an image")
    (tmp_path / "a_file").write_text("not a folder")
    flags = [tmp_path / "empty" if f == "EMPTY" else f.replace("AFILE", str(tmp_path / "a_file"))
             if isinstance(f, str) else f for f in flags]
    words = [w.replace("AFILE", str(tmp_path / "a_file")) if isinstance(w, str) else w for w in words]
    result = run(python(script, *SMALL, *flags, "--ckpt-dir", tmp_path / "ckpt"), timeout=60, check=False)
    check_user_error(result, *words)
    assert not (tmp_path / "ckpt").exists()


class Mkdir:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.mark.parametrize("script,kind", [("dp_resnet.py", "garbage"),  # truncated: under torchrun below
                                         ("ddp_resnet.py", "altered"),
                                         ("dp_resnet.py", "altered"), ("ddp_resnet.py", "wrong-model"),
                                         ("ddp_resnet.py", "foreign"), ("ddp_resnet.py", "code")])
def test_unreadable_checkpoint_on_resume(script, kind, uninterrupted, tmp_path):
    good = (uninterrupted[0] / "epoch_2.pt").read_bytes()
    bad = tmp_path / "epoch_3.pt"
    (tmp_path / "epoch_2.pt").write_bytes(good)
    flags = [*SPAWN] if script == "ddp_resnet.py" else [*SMALL]
    if kind == "truncated":
        bad.write_bytes(good[: len(good) // 2])
    elif kind == "garbage":
        bad.write_bytes(os.urandom(4096))
    elif kind == "empty":
        bad.write_bytes(b"")
    elif kind == "altered":  # one flipped byte in a tensor: torch.load alone would not notice
        altered = bytearray(good)
        altered[len(altered) // 2] ^= 0xFF
        bad.write_bytes(bytes(altered))
        (tmp_path / "epoch_3.pt.sha256").write_bytes((uninterrupted[0] / "epoch_2.pt.sha256").read_bytes())
    elif kind == "foreign":
        torch.save({"weights": torch.zeros(3)}, bad)
    elif kind == "code":  # a pickle that runs code when loaded: weights_only=True refuses it
        torch.save({"model_state_dict": Mkdir(tmp_path / "ran")}, bad)
    else:
        bad = tmp_path / "epoch_2.pt"
        flags = [f if f != "resnet18" else "resnet34" for f in flags]
    result = run(python(script, *flags, "--epochs", 4, "--resume", "--ckpt-dir", tmp_path), timeout=60, check=False)
    check_user_error(result, bad)
    assert not (tmp_path / "ran").exists()
    assert not list(tmp_path.glob("epoch_[4-9].pt"))  # nothing trained


def test_unreadable_checkpoint_under_torchrun_ends_the_job(uninterrupted, tmp_path):
    (tmp_path / "epoch_2.pt").write_bytes((uninterrupted[0] / "epoch_2.pt").read_bytes()[:5000])
    result = run(torchrun("ddp_resnet.py", 2, *DDP, "--epochs", 4, "--resume", "--ckpt-dir", tmp_path),
                 timeout=TIMEOUT, check=False)
    assert result.returncode != 0
    # Each rank checks the file itself; torchrun may stop the slower rank before it gets to print.
    errors = re.findall(r"^error: cannot load checkpoint (\S+) ", result.stderr, re.M)
    assert 1 <= len(errors) <= 2 and set(errors) == {str(tmp_path / "epoch_2.pt")}, result.stderr[-3000:]
    assert 'ddp_resnet.py", line' not in result.stderr  # no traceback from the script, only torchrun's summary
