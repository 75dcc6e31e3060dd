"""run_all.sh: runs every script, prints one summary table, fails when a run fails, leaves no
process behind, and runs again in the same RUNS_DIR."""

import os
import shutil
import signal
import sys
import time

import pytest

from conftest import DEBIAN_FMNIST, ROOT, finish, run, start, tagged

SCRIPTS = ["ddp_gather.py", "ddp_fashionmnist.py", "dp_resnet.py", "ddp_resnet.py"]
COLUMNS = ["script", "launch", "world", "backend", "seconds", "result"]
# stand-ins that write their metrics at once, to check run_all.sh itself
METRICS = "import json, sys\nout = sys.argv[sys.argv.index('--metrics-out') + 1]\n"
GATHER = (
    METRICS
    + "json.dump({'world_size': 2, 'gathered': [{'dict': {'rank': r}} for r in (0, 1)]}, open(out, 'w'))\n"
)
OK = METRICS + "json.dump({'images_per_sec': 12.5, 'final_loss': 2.0}, open(out, 'w'))\n"
# a ResNet stand-in that fails, as the real scripts refuse, where a checkpoint is left over
FRESH = (
    "import glob, sys\nckpt = sys.argv[sys.argv.index('--ckpt-dir') + 1]\n"
    "assert not glob.glob(ckpt + '/epoch_*.pt'), 'a used checkpoint folder'\n" + OK
)


def run_all(*args, cwd=ROOT, runs=None, timeout=400, check=True, env=None):
    env = {"RUNS_DIR": str(runs or cwd / "runs"), "PYTHON": sys.executable, **(env or {})}
    return run(["bash", str(cwd / "run_all.sh"), *args], timeout, cwd=cwd, env=env, check=check)


def table(stdout: str) -> dict:
    """The summary table's rows by (script, launch), as dicts of stripped cells."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].endswith(".py"):
            assert len(cells) == len(COLUMNS), line
            rows[cells[0], cells[1]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def copy_with(folder, **scripts) -> None:
    """run_all.sh in `folder` with these scripts: text (a stand-in), or None (the real one)."""
    folder.mkdir(exist_ok=True)
    shutil.copy(ROOT / "run_all.sh", folder)
    for name, text in scripts.items():
        if text is None:
            shutil.copy(ROOT / f"{name}.py", folder)
        else:
            (folder / f"{name}.py").write_text(text)


@pytest.mark.learned  # one real FashionMNIST epoch: 0.82 on three kernel settings, the bar 0.5
def test_run_all_passes_twice_in_a_row_and_names_every_script(tmp_path):
    res = run_all(runs=tmp_path)
    rows = table(res.stdout)
    launches = ["spawn", "torchrun", "spawn", "single", "spawn"]  # gather twice, then each once
    assert list(rows) == list(zip([SCRIPTS[0], *SCRIPTS], launches, strict=True)), res.stdout
    for row in rows.values():
        assert row["result"].startswith("ok: ") and float(row["seconds"]) > 0, row
    assert {r["backend"] for r in rows.values()} == {"gloo", "none"}  # no GPU: 2 CPU processes
    assert rows["ddp_resnet.py", "spawn"]["world"] == "2"
    for launch in ("spawn", "torchrun"):
        assert rows["ddp_gather.py", launch]["result"] == "ok: gathered ranks [0, 1]"
    fm = rows["ddp_fashionmnist.py", "spawn"]["result"]
    assert "test_accuracy" in fm
    if DEBIAN_FMNIST.is_dir():  # unzipped into ./data: real images, not random ones
        assert fm.endswith(", real data") and float(fm.split()[2].strip(",")) > 0.5, fm
    assert res.stdout.rstrip().endswith("run_all: all 5 runs passed")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch_1.pt", "epoch_2.pt"]
    # again in the same RUNS_DIR, where the last run's checkpoints are: every run starts fresh
    # (quick stand-ins that fail on a used checkpoint folder, as the real ResNets do)
    copy_with(tmp_path / "again", ddp_gather=GATHER, ddp_fashionmnist=OK)
    copy_with(tmp_path / "again", dp_resnet=FRESH, ddp_resnet=FRESH)
    res = run_all(cwd=tmp_path / "again", runs=tmp_path, timeout=120)
    assert res.stdout.rstrip().endswith("run_all: all 5 runs passed"), res.stdout


def test_run_all_keeps_going_and_fails_when_a_run_fails(tmp_path):
    (tmp_path / "bin").mkdir()
    copy_with(tmp_path, ddp_gather=GATHER, ddp_fashionmnist="import sys\nsys.exit('boom')\n")
    copy_with(tmp_path, dp_resnet=OK, ddp_resnet="import sys\n")  # exits 0, writes nothing
    # and an nvidia-smi that lists a GPU torch cannot see (as a torch built for a newer driver)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    path = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    res = run_all(cwd=tmp_path, timeout=120, check=False, env=path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.startswith("run_all: nvidia-smi lists GPUs, torch ")
    assert res.stderr.rstrip().endswith("; on CPU") and res.stderr.count("\n") == 1
    rows = table(res.stdout)
    assert len(rows) == 5
    assert rows["ddp_fashionmnist.py", "spawn"]["result"] == "FAILED (exit 1)"
    assert "boom" in res.stdout  # the failed run's last lines
    assert rows["ddp_resnet.py", "spawn"]["result"] == "FAILED (no metrics)"
    assert rows["dp_resnet.py", "single"]["result"] == "ok: images_per_sec 12.5, final_loss 2"
    for launch in ("spawn", "torchrun"):
        assert rows["ddp_gather.py", launch]["result"] == "ok: gathered ranks [0, 1]"
    assert res.stdout.rstrip().endswith("run_all: 2 of 5 runs FAILED")


def test_a_killed_run_fails_its_row_and_leaves_no_process(tmp_path):
    """SIGKILL the launcher process of one run: its ranks must go too, and run_all.sh exits 1."""
    copy_with(tmp_path, ddp_gather=GATHER, ddp_fashionmnist=None, dp_resnet=OK, ddp_resnet=OK)
    env = {"RUNS_DIR": str(tmp_path / "runs"), "PYTHON": sys.executable}
    proc = start(["bash", str(tmp_path / "run_all.sh")], cwd=tmp_path, env=env)
    deadline, launcher = time.monotonic() + 120, None
    while launcher is None and time.monotonic() < deadline:
        for pid in tagged(proc.mark):  # this run's processes only
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                children = open(f"/proc/{pid}/task/{pid}/children").read().split()
            except OSError:
                continue
            # the launcher, not `timeout`; with the resource tracker and at least one rank
            if cmdline[1:2] == [b"ddp_fashionmnist.py"] and len(children) >= 2:
                launcher = pid
        time.sleep(0.2)
    assert launcher, "the FashionMNIST run never started its ranks"
    time.sleep(2)
    os.kill(launcher, signal.SIGKILL)
    res = finish(proc, timeout=180, check=False)  # fails if any rank outlived its launcher
    assert res.returncode == 1
    rows = table(res.stdout)
    assert rows["ddp_fashionmnist.py", "spawn"]["result"] == "FAILED (exit 137)"
    assert [r["result"].startswith("ok: ") for r in rows.values()].count(True) == 4  # went on


def test_an_unknown_option_is_one_line_and_exit_2():
    res = run(["bash", str(ROOT / "run_all.sh"), "--fast"], timeout=30, check=False)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == "run_all: unknown option --fast (see --help)\n"
