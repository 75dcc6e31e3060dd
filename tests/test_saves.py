"""Checkpoints at the worst moments (a full disk, Ctrl-C during a save or mid-epoch, SIGKILL)
and one run per checkpoint folder. CPU, gloo, loopback; every run under a hard timeout."""
import hashlib
import os
import re
import resource
import signal
import socket
import subprocess
import time

import pytest

from conftest import ONE_THREAD, RESNET, finish, lines, python, run, same_weights, start, torchrun

TIMEOUT = 180
LONG = ["--max-steps", 6, "--synthetic-size", 48, "--log-every", 2]  # 6 steps an epoch


def command(how: str, *flags) -> list:
    flags = [*RESNET, *flags]
    if how == "spawn":
        return python("ddp_resnet.py", "--nprocs", 2, *flags)
    if how == "torchrun":
        return torchrun("ddp_resnet.py", 2, *flags)
    return python("dp_resnet.py", *[f for f in flags if f not in ("--timeout", 60)])


def resumable(folder) -> list:
    """The folder holds nothing half-done: no temporary file, and every sha256 next to the
    checkpoint it matches. Returns the epochs saved."""
    names = set(os.listdir(folder))
    assert not [n for n in names if ".tmp" in n], sorted(names)
    for name in names - {".lock"}:
        ckpt = name.removesuffix(".sha256")
        assert re.fullmatch(r"epoch_\d+\.pt", ckpt) and ckpt in names, sorted(names)
        if name.endswith(".sha256"):
            digest = hashlib.sha256((folder / ckpt).read_bytes()).hexdigest()
            assert (folder / name).read_text() == f"{digest}  {ckpt}\n"
    return sorted(int(n[6:-3]) for n in names if n.endswith(".pt"))


def no_traceback(res, how: str) -> None:
    """Our processes print no traceback; under torchrun, torchrun's own messages are its business."""
    if how == "torchrun":
        assert 'ddp_resnet.py", line' not in res.stderr, res.stderr[-3000:]
    else:
        assert res.returncode == 130 and res.stderr.strip().splitlines() == ["interrupted"], res.stderr[-3000:]


def ctrl_c(proc, folder, ready) -> float:
    """SIGINT the run's process group, as a terminal's Ctrl-C does, once ready(names in folder)
    holds (polled every millisecond); the time it was sent."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        if folder.exists() and ready(os.listdir(folder)):
            os.killpg(proc.pid, signal.SIGINT)
            return time.monotonic()
        time.sleep(0.001)
    res = finish(proc, timeout=10, check=False)
    pytest.fail(f"the moment never came: {sorted(os.listdir(folder))}\n{res.stderr[-3000:]}")


@pytest.mark.parametrize("how", ["spawn", "torchrun", "dp"])
def test_ctrl_c_mid_epoch_then_during_a_save_then_resume(how, tmp_path):
    folder = tmp_path / "ckpt"
    flags = [*LONG, "--epochs", 3, "--ckpt-dir", folder]
    proc = start(command(how, *flags))  # Ctrl-C mid-epoch: once step 2 of epoch 2 is reported
    for _ in lines(proc, TIMEOUT, until=lambda line: line.startswith("epoch 2/3 | step 2/6")):
        pass
    assert proc.poll() is None, finish(proc, timeout=10, check=False).stderr[-3000:]
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    res = finish(proc, timeout=30, check=False)  # also fails if any process is left
    assert time.monotonic() - sent < 15
    no_traceback(res, how)
    assert resumable(folder) == [1]
    proc = start(command(how, *flags, "--resume"))  # Ctrl-C while a checkpoint is being written
    sent = ctrl_c(proc, folder, lambda names: any(n.endswith(".tmp") for n in names))
    res = finish(proc, timeout=30, check=False)
    assert time.monotonic() - sent < 15
    no_traceback(res, how)
    assert f"--resume: continuing after {folder / 'epoch_1.pt'}" in res.stdout
    saved = resumable(folder)
    res = run(command(how, *flags, "--resume"), timeout=TIMEOUT)
    assert f"--resume: continuing after {folder / f'epoch_{saved[-1]}.pt'}" in res.stdout
    assert resumable(folder) == [1, 2, 3]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 150 MiB: room for one resnet18 checkpoint (89.5 MB) and its sha256, not two."""
    disk = tmp_path / "small"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=150m", "tmpfs", disk],
                           capture_output=True, text=True)
    if mount.returncode:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root and must mount a tmpfs: {mount.stderr}")
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.strip()}); see the file-size test")
    yield disk
    subprocess.run(["umount", "-l", disk])


@pytest.mark.parametrize("how", ["spawn", "torchrun"])
def test_full_disk_during_a_save(how, small_disk, uninterrupted):
    folder = small_disk / "ckpt"
    flags = ["--epochs", 4, "--ckpt-dir", folder]
    res = run(command(how, *flags), timeout=TIMEOUT, check=False, env=ONE_THREAD)
    line = (f"error: cannot save {folder / 'epoch_2.pt'} (No space left on device); earlier "
            f"checkpoints are intact, free some space and rerun with --resume")
    assert res.returncode == 1
    if how == "spawn":
        assert res.stderr.strip().splitlines() == [line]
    else:  # torchrun adds its failure summary
        assert line in res.stderr.splitlines() and 'ddp_resnet.py", line' not in res.stderr
    assert resumable(folder) == [1] and sorted(os.listdir(folder)) == [".lock", "epoch_1.pt", "epoch_1.pt.sha256"]
    if how == "spawn":  # space freed: --resume ends where a run never stopped ends
        subprocess.run(["mount", "-o", "remount,size=450m", small_disk], check=True)
        run(command(how, *flags, "--resume"), timeout=TIMEOUT, env=ONE_THREAD)
        same_weights(uninterrupted[0] / "epoch_4.pt", folder / "epoch_4.pt")


def test_file_size_limit_during_a_dp_save(tmp_path):
    """No mount needed: a file-size limit below one checkpoint makes the first save fail."""
    folder = tmp_path / "ckpt"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (50 * 2**20, 50 * 2**20))
    res = run(command("dp", "--epochs", 2, "--ckpt-dir", folder), timeout=TIMEOUT, check=False,
              preexec_fn=limit)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"error: cannot save {folder / 'epoch_1.pt'} (File too large); earlier checkpoints are intact, "
        f"fix that and rerun with --resume"]
    assert sorted(os.listdir(folder)) == [".lock"]
    res = run(command("dp", "--epochs", 2, "--resume", "--ckpt-dir", folder), timeout=TIMEOUT)
    assert resumable(folder) == [1, 2]


def test_two_runs_on_one_folder(uninterrupted, tmp_path):
    """Started together with different seeds: one trains alone, exactly as a run alone with its
    seed; the other stops before training with one line naming the holder."""
    folder = tmp_path / "ckpt"
    began = time.monotonic()
    procs = {seed: start(command("spawn", "--epochs", 4, "--seed", seed, "--ckpt-dir", folder), env=ONE_THREAD)
             for seed in (0, 1)}
    ended = {}
    while len(ended) < 2 and time.monotonic() - began < TIMEOUT:
        ended.update({s: time.monotonic() - began for s, p in procs.items() if s not in ended and p.poll() is not None})
        time.sleep(0.05)
    results = {seed: finish(proc, timeout=10, check=False) for seed, proc in procs.items()}
    assert sorted(r.returncode for r in results.values()) == [0, 1], [r.stderr[-2000:] for r in results.values()]
    winner = next(s for s, r in results.items() if r.returncode == 0)
    loser = 1 - winner
    assert re.fullmatch(rf"error: --ckpt-dir {folder} is in use by another run \(host {socket.gethostname()}, "
                        r"pid \d+\); wait for it to end, or use another folder\n", results[loser].stderr)
    assert "epoch 1/4" not in results[loser].stdout  # stopped before training
    assert ended[loser] < ended[winner] and ended[loser] < 40, ended  # 6 s here: the launcher checks
    reference = uninterrupted[0]
    if winner == 1:
        reference = tmp_path / "alone"
        run(command("spawn", "--epochs", 4, "--seed", 1, "--ckpt-dir", reference), timeout=TIMEOUT, env=ONE_THREAD)
    assert resumable(folder) == [1, 2, 3, 4]
    for epoch in (1, 4):
        same_weights(reference / f"epoch_{epoch}.pt", folder / f"epoch_{epoch}.pt")


def test_dp_second_run_refused_and_a_killed_run_leaves_no_lock(tmp_path):
    folder = tmp_path / "ckpt"
    first = start(command("dp", "--max-steps", 1000, "--synthetic-size", 4000, "--epochs", 2, "--ckpt-dir", folder))
    deadline = time.monotonic() + TIMEOUT
    while f"pid {first.pid}" not in ((folder / ".lock").read_text() if (folder / ".lock").exists() else ""):
        assert time.monotonic() < deadline and first.poll() is None, "the first run never took the folder"
        time.sleep(0.05)
    second = run(command("dp", "--epochs", 2, "--ckpt-dir", folder), timeout=TIMEOUT, check=False)
    assert second.returncode == 1
    assert second.stderr.strip().splitlines() == [
        f"error: --ckpt-dir {folder} is in use by another run (host {socket.gethostname()}, pid {first.pid}); "
        f"wait for it to end, or use another folder"]
    os.killpg(first.pid, signal.SIGKILL)  # no clean-up of any kind
    finish(first, timeout=30, check=False)
    run(command("dp", "--epochs", 1, "--resume", "--ckpt-dir", folder), timeout=TIMEOUT)
    assert resumable(folder) == [1]


def test_ckpt_dir_that_cannot_be_a_folder_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file where the folder should be")
    res = run(command("spawn", "--ckpt-dir", tmp_path / "taken"), timeout=60, check=False)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [f"error: cannot use --ckpt-dir {tmp_path / 'taken'} (File exists)"]
