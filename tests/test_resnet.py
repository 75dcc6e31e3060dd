"""ddp_resnet.py and dp_resnet.py as a user runs them: CPU, gloo, resnet18 on 32 px synthetic
images, 2 steps an epoch; checkpoints that load into a plain model, resume, and refusals."""

import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch
import torchvision

from conftest import (
    DP,
    ONE_THREAD,
    RESNET,
    finish,
    free_port,
    last_line,
    metrics,
    python,
    run,
    start,
    started_loader_workers,
)

TIMEOUT = 180


def command(script: str, *flags, ranks=2) -> list:
    if script == "dp_resnet.py":
        return python(script, *DP, *flags)
    return python(script, *RESNET, "--nprocs", ranks, *flags)


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
        k: m[k] for k in ("script", "world_size", "backend", "device", "epochs_run", "steps")
    } == {
        "script": "ddp_resnet.py",
        "world_size": 2,
        "backend": "gloo",
        "device": "cpu",
        "epochs_run": 3,
        "steps": 2,
    }
    assert math.isfinite(m["final_loss"]) and m["images_per_sec"] > 0
    assert m["checkpoint"] == str(folder / "epoch_3.pt")
    check_checkpoints(folder, [1, 2, 3])
    lines = out.splitlines()
    assert lines[0] == (
        "start | ddp_resnet.py | world_size 2 | backend gloo | device cpu | model ResNet "
        "| data synthetic (16 images) | batch 4 x 2 | lr 0.01 | steps 2 | epochs 1-3 "
        f"| ckpt_dir {folder}"
    )
    # each epoch: a progress line at its last step, then its summary
    assert [line.split(" |")[0] for line in lines[1:]] == [
        *[f"epoch {e}/3" for e in (1, 1, 2, 2, 3, 3)],
        "done",
    ]
    assert re.fullmatch(r"epoch 1/3 \| step 2/2 \| loss \d+\.\d{4} \| \d+ img/s", lines[1])
    assert re.fullmatch(rf"epoch 3/3 \| loss {m['final_loss']:.4f} \| \d+ img/s", lines[6])
    assert lines[7] == (
        f"done | epochs_run 3 | final_loss {m['final_loss']} | checkpoint {folder / 'epoch_3.pt'}"
    )


@pytest.mark.parametrize("script", ["ddp_resnet.py", "dp_resnet.py"])
def test_a_fresh_run_refuses_a_folder_with_checkpoints(script, uninterrupted, tmp_path):
    """The stale-checkpoint defect: a 3-epoch run, then a fresh 1-epoch run with another --lr in
    the same folder left epoch_2 and epoch_3 of the first behind, and a later --resume took them
    for its own. Now the fresh run stops before training and says how to go on."""
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
        == f"error: {ckpt / 'epoch_3.pt'} exists: add --resume to go on, or use another --ckpt-dir\n"
    )
    assert "start |" not in res.stdout
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    if script == "dp_resnet.py":
        flags = [
            "--epochs",
            4,
            "--ckpt-dir",
            ckpt,
            "--resume",
            "--metrics-out",
            tmp_path / "m.json",
        ]
        res = run(command(script, *flags), timeout=TIMEOUT)
        assert res.stdout.splitlines()[0] == (
            "start | dp_resnet.py | gpus 0 | device cpu | model ResNet | data synthetic (8 "
            f"images) | batch 4 | lr 0.01 | steps 2 | epochs 4-4 | ckpt_dir {ckpt} | resuming "
            "from epoch_3.pt"
        )
        assert (ckpt / "epoch_4.pt").is_file() and metrics(tmp_path / "m.json")["epochs_run"] == 1
        assert res.stderr == ""  # no warning to read past (the tutorial's pretrained=False)
        res = run(command(script, *flags), timeout=TIMEOUT)  # finished: trains nothing
        assert (
            res.stdout.splitlines()[-1] == "done | epochs_run 0 | final_loss None | checkpoint None"
        )
        check_checkpoints(ckpt, [1, 2, 3, 4])


def test_a_rank_without_local_rank_still_refuses_a_used_folder(uninterrupted, tmp_path):
    """RANK set and LOCAL_RANK empty (`LOCAL_RANK=$SLURM_LOCALID` outside srun): the process
    joins the group as that rank. Once, the launcher read the empty LOCAL_RANK as "not local
    rank 0" and skipped every check, and a fresh run overwrote another run's checkpoints, exit
    0. Rank 0 decides inside the group now, which no environment can skip."""
    ckpt = tmp_path / "ck"
    shutil.copytree(uninterrupted[0], ckpt, ignore=shutil.ignore_patterns("*.json"))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "", **ONE_THREAD}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    res = run(
        python("ddp_resnet.py", *RESNET, "--epochs", 1, "--ckpt-dir", ckpt),
        timeout=TIMEOUT,
        env=env,
        check=False,
    )
    assert res.returncode == 1 and "start |" not in res.stdout, res.stderr[-3000:]
    assert (
        res.stderr
        == f"error: {ckpt / 'epoch_3.pt'} exists: add --resume to go on, or use another --ckpt-dir\n"
    )
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


@pytest.mark.parametrize("script", ["ddp_resnet.py", "dp_resnet.py"])
def test_lr_on_resume_is_the_flags(script, uninterrupted, tmp_path):
    """--lr 0.5 --resume: the start line says lr 0.5, and it trains at 0.5. Once, the reload of
    the optimizer's state put the checkpoint's 0.01 back at every epoch, silently. Files named
    like checkpoints that a run never writes are left alone."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    shutil.copy(uninterrupted[0] / "epoch_2.pt", ckpt)
    # not checkpoints of ours: once, epoch_010.pt was taken for an epoch_10.pt, and epoch_1³.pt
    # was a ValueError traceback
    for name in ("epoch_010.pt", "epoch_1³.pt", "epoch_x.pt"):
        (ckpt / name).write_bytes(b"a user's")
    res = run(
        command(script, "--epochs", 3, "--resume", "--lr", 0.5, "--ckpt-dir", ckpt, ranks=1),
        timeout=TIMEOUT,
        env=ONE_THREAD,
    )
    start_line = res.stdout.splitlines()[0]
    assert "| lr 0.5 |" in start_line and start_line.endswith("resuming from epoch_2.pt")
    saved = torch.load(ckpt / "epoch_3.pt", weights_only=True)["optimizer_state_dict"]
    assert [group["lr"] for group in saved["param_groups"]] == [0.5]


class Mkdir:
    """A pickle that would create a folder when loaded without weights_only."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.mark.parametrize("script", ["ddp_resnet.py", "dp_resnet.py"])
def test_a_bad_checkpoint_on_resume_fails_before_training(script, uninterrupted, tmp_path):
    """Damaged, another model's, or a pickle that would run code: torch's own error names the
    cause, before any training step; the pickled code never runs."""
    good = (uninterrupted[0] / "epoch_1.pt").read_bytes()
    cases = {
        "cut": (good[: len(good) // 2], [], "PytorchStreamReader failed reading zip archive"),
        "other model": (
            good,
            ["--arch", "resnet34"],
            "Error(s) in loading state_dict for ResNet:",
        ),
        "code": (
            pickle.dumps({"model_state_dict": Mkdir(tmp_path / "pwned")}, protocol=2),
            [],
            "Weights only load failed",
        ),
    }
    if script == "ddp_resnet.py":  # the code never runs; the other two: DataParallel's
        cases = {"code": cases["code"]}
    procs = {}  # all at once: each stops before training, in its own folder
    for name, (data, flags, _) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "epoch_1.pt").write_bytes(data)
        procs[name] = start(
            command(script, "--epochs", 2, "--ckpt-dir", folder, "--resume", *flags, ranks=1)
        )
    for name, (_, _, cause) in cases.items():
        folder, res = tmp_path / name.replace(" ", "_"), finish(procs[name], TIMEOUT, check=False)
        assert res.returncode != 0 and cause in res.stderr, (name, res.stderr[-3000:])
        assert "| step " not in res.stdout and not (folder / "epoch_2.pt").exists()
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("script", ["ddp_resnet.py", "dp_resnet.py"])
def test_bad_input_fails_before_training_and_names_the_cause(script, tmp_path, read_only):
    """Where the launcher checks in a line or two, one line of ours; elsewhere torch's own
    error. A --ckpt-dir that cannot be written is refused before the first step: once, a
    read-only folder trained a whole epoch, then failed with three chained tracebacks. (The
    checks that are the same lines in both scripts are asked of one.)"""
    folder, why = read_only
    reason = why.split("] ")[1]
    missing = tmp_path / "missing"
    cases = [  # (flags, exit code, the whole last line, or torch's words in stderr)
        (["--data", missing], 1, f"error: --data {missing}: no such folder"),
        (["--ckpt-dir", folder], 1, f"error: --ckpt-dir {folder}: {reason}"),
    ]
    if script == "ddp_resnet.py":  # one batch fits, one a rank (6400 images each) does not
        cases.append(
            (["--batch-size", 6401], 1, "error: 12800 images: too few for --batch-size 6401")
        )
        # once, an empty folder counted as the current one, and the saves went to /epoch_N.pt;
        # with a missing --data, a script that takes the empty folder stops before any save
        empty_ckpt = ["--ckpt-dir", "", "--data", missing]
        cases.append((empty_ckpt, 2, "argument --ckpt-dir: invalid nonempty value: ''"))
        # once, every step trained to nan, and the run exited 0
        cases.append((["--lr", "nan"], 2, "argument --lr: invalid learning_rate value: 'nan'"))
    else:
        cases.append((["--batch-size", 13000], 1, "error: 12800 images, too few for one batch"))
        cases.append((["--arch", "googlenet"], 2, "argument --arch: invalid choice: 'googlenet'"))
        # `--data "$DATA"`, DATA unset: once, random images, silently
        cases.append((["--data", ""], 2, "argument --data: invalid nonempty value: ''"))
        empty = tmp_path / "empty"
        empty.mkdir()
        cases.append((["--data", empty], 1, f"Couldn't find any class folder in {empty}."))
    procs = [start(command(script, "--ckpt-dir", tmp_path / "ck", *f)) for f, *_ in cases]
    if script == "ddp_resnet.py":  # a fresh run in a read-only current folder
        procs.append(start(command(script), cwd=folder))
        cases.append((["(read-only cwd)"], 1, f"error: --ckpt-dir model_checkpoints: {reason}"))
    for proc, (flags, code, words) in zip(procs, cases, strict=True):
        res = finish(proc, TIMEOUT, check=False)
        assert res.returncode == code and "start |" not in res.stdout, (flags, res.stderr)
        if words.startswith("error: "):
            assert last_line(res.stderr) == words, (flags, res.stderr)
        else:
            assert words in res.stderr, (flags, res.stderr[-3000:])


def test_dataparallel_lines_reach_a_log_file_as_they_are_printed(tmp_path):
    """Under nohup, SLURM or CI, stdout is a file and Python holds its lines back: once,
    dp_resnet.py's log stayed empty until exit, and a SIGKILL lost it all. Its lines are
    flushed one by one now, as the DDP scripts' print0 does: once epoch_1.pt exists, the start
    line and epoch 1's lines are in the file, SIGKILL or not."""
    log, ckpt = tmp_path / "log", tmp_path / "ck"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    cmd = python("dp_resnet.py", *DP, "--epochs", 100, "--ckpt-dir", ckpt)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (ckpt / "epoch_1.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lines = log.read_text().splitlines()
    assert lines[0].startswith("start | dp_resnet.py | gpus 0 | device cpu"), lines
    assert lines[1].startswith("epoch 1/100 | step 2/2 | loss "), lines


@pytest.mark.parametrize("script", ["ddp_resnet.py", "dp_resnet.py"])
def test_loader_workers_come_from_a_forkserver_and_ignore_ctrl_c(script, tmp_path):
    """Each epoch's loader workers start from a forkserver that imported torch once. -X
    importtime lists each process's imports: torch comes in the launcher, the rank (ddp) and the
    forkserver, not in the 6 workers of 3 epochs; a worker that imports torch takes seconds, every
    epoch (2 img/s on an H200). dp_resnet.py forked its workers: Python lost a Ctrl-C that came
    during a fork, and the run went on (a fork of a process with CUDA is slow).
    Ctrl-C reaches the workers too; on a GPU one that died mid-batch left a traceback (the rank's
    pin_memory thread was fetching from it). Here each worker, once started, gets SIGINT alone:
    the run goes on to the end, its loader ending the workers. Before, a worker exited."""
    flags = ["--workers", 2, "--epochs", 3, "--ckpt-dir", tmp_path / "ckpt"]
    # 10 steps an epoch: the workers live long enough to be found on a fast machine too
    cmd = command(script, *flags, "--max-steps", 10, ranks=1)
    cmd[1:1] = ["-X", "importtime"]
    # run from another folder, where the forkserver cannot import the script: torch, still once
    proc, interrupted = start(cmd, cwd=tmp_path), set()

    def interrupt_workers():
        while proc.poll() is None:
            for pid in set(started_loader_workers(proc.mark)) - interrupted:
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:  # its epoch just ended
                    continue
                interrupted.add(pid)
            time.sleep(0.1)

    threading.Thread(target=interrupt_workers, daemon=True).start()
    res = finish(proc, TIMEOUT)
    assert "epoch 3/3 | loss" in res.stdout and len(interrupted) >= 4, (interrupted, res.stdout)
    imports = 3 if script == "ddp_resnet.py" else 2
    # one line a process: "| torch", or indented under the script the forkserver imports
    assert len(re.findall(r"\| +torch$", res.stderr, re.M)) == imports, res.stderr[-2000:]
