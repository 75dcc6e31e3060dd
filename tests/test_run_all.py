"""run_all.sh: runs every script, prints one summary table, fails when a run fails, leaves no
process behind, and runs again in a used RUNS_DIR."""

import os
import shutil
import signal
import sys
import time

import pytest

from conftest import DEBIAN_FMNIST, ROOT, finish, metrics, run, start, tagged

SCRIPTS = ["ddp_gather.py", "ddp_fashionmnist.py", "dp_resnet.py", "ddp_resnet.py"]
COLUMNS = ["script", "launch", "world", "backend", "seconds", "result"]
# stand-ins that write their metrics at once, to check run_all.sh itself
METRICS = "import json, sys\nout = sys.argv[sys.argv.index('--metrics-out') + 1]\n"
GATHER = (
    METRICS
    + "json.dump({'world_size': 2, 'gathered': [{'dict': {'rank': r}} for r in (0, 1)]}, open(out, 'w'))\n"
)
# a ResNet stand-in that fails, as the real scripts refuse, where a checkpoint is left over
FRESH = (
    "import glob, sys\nckpt = sys.argv[sys.argv.index('--ckpt-dir') + 1]\n"
    "assert not glob.glob(ckpt + '/epoch_*.pt'), 'a used checkpoint folder'\n"
)


def start_run_all(cwd, runs, env=None):
    """bash run_all.sh in `cwd`, with its logs, metrics and checkpoints in `runs`."""
    env = {"RUNS_DIR": str(runs), "PYTHON": sys.executable, **(env or {})}
    return start(["bash", str(cwd / "run_all.sh")], cwd=cwd, env=env)


def table(stdout: str) -> dict:
    """The summary table's rows by (script, launch), as dicts of stripped cells; each
    (script, launch) once."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].endswith(".py"):
            assert len(cells) == len(COLUMNS), line
            assert (cells[0], cells[1]) not in rows, stdout
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


def fake_nvidia_smi(folder) -> dict:
    """A PATH with an nvidia-smi that lists a GPU torch cannot see (a torch built for a newer
    driver, say)."""
    (folder / "bin").mkdir()
    smi = folder / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    return {"PATH": f"{folder / 'bin'}:{os.environ['PATH']}"}


def kill_the_launcher(proc, script: str) -> None:
    """SIGKILL the launcher of `script`'s run once it has started its ranks."""
    deadline, launcher = time.monotonic() + 120, None
    while launcher is None and time.monotonic() < deadline:
        for pid in tagged(proc.mark):  # this run's processes only
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                children = open(f"/proc/{pid}/task/{pid}/children").read().split()
            except OSError:
                continue
            # the launcher, not `timeout`; with the resource tracker and at least one rank
            if cmdline[1:2] == [script.encode()] and len(children) >= 2:
                launcher = pid
        time.sleep(0.2)
    assert launcher, f"the {script} run never started its ranks"
    time.sleep(2)
    os.kill(launcher, signal.SIGKILL)


@pytest.mark.learned  # one real FashionMNIST epoch: 0.82 on three kernel settings, the bar 0.5
def test_run_all_passes_where_nvidia_smi_lists_a_gpu_torch_cannot_see(tmp_path):
    """The README's first command, where nvidia-smi lists a GPU that torch cannot see: one line
    says so, and every run passes on the CPU."""
    res = finish(start_run_all(ROOT, tmp_path, fake_nvidia_smi(tmp_path)), timeout=400)
    assert res.stderr.startswith("run_all: nvidia-smi lists GPUs, torch ")
    assert res.stderr.rstrip().endswith("; on CPU") and res.stderr.count("\n") == 1
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
    dp = metrics(tmp_path / "dp_resnet_single_1.json")
    ips, loss = dp["images_per_sec"], dp["final_loss"]
    assert (
        rows["dp_resnet.py", "single"]["result"]
        == f"ok: images_per_sec {ips:.4g}, final_loss {loss:.4g}"
    )
    assert res.stdout.rstrip().endswith("run_all: all 5 runs passed")
    # what the next run in this RUNS_DIR finds (the next test)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch_1.pt", "epoch_2.pt"]
    assert len((tmp_path / "runs.tsv").read_text().splitlines()) == 5


def test_again_in_a_used_runs_dir_goes_on_past_failed_and_killed_runs(tmp_path):
    """Again in a RUNS_DIR as the run above leaves it: every run starts fresh, and the table
    has this run's rows alone. A run that fails, one that writes no metrics and one whose
    launcher is killed (its ranks must go too) each fail their row, and the others still run;
    exit 1. Stand-ins, quick, except the FashionMNIST run, whose launcher is killed; the
    ResNets' stand-ins fail on a used checkpoint folder, as the real ResNets do."""
    (tmp_path / "ckpt").mkdir()
    for name in ("epoch_1.pt", "epoch_2.pt"):
        (tmp_path / "ckpt" / name).touch()
    old = f"dp_resnet.py\tsingle\t1\tnone\t\t0\t1\t2\t{tmp_path / 'dp_resnet_single_1'}\n"
    (tmp_path / "runs.tsv").write_text(old * 5)
    again = tmp_path / "again"
    copy_with(again, ddp_gather=GATHER, ddp_fashionmnist=None)
    # dp_resnet.py fails, ddp_resnet.py exits 0 but writes no metrics
    copy_with(again, dp_resnet=FRESH + "sys.exit('boom')\n", ddp_resnet=FRESH)
    proc = start_run_all(again, tmp_path)
    kill_the_launcher(proc, "ddp_fashionmnist.py")
    res = finish(proc, timeout=180, check=False)  # fails if any rank outlived its launcher
    assert res.returncode == 1, res.stdout + res.stderr
    rows = table(res.stdout)
    # this run's 5 rows, none left from the run before (table() refuses a row twice)
    assert len(rows) == 5
    for launch in ("spawn", "torchrun"):
        assert rows["ddp_gather.py", launch]["result"] == "ok: gathered ranks [0, 1]"
    assert rows["ddp_fashionmnist.py", "spawn"]["result"] == "FAILED (exit 137)"
    assert rows["dp_resnet.py", "single"]["result"] == "FAILED (exit 1)"  # went on
    assert "boom" in res.stdout  # the failed run's last lines
    assert "a used checkpoint folder" not in res.stdout
    assert rows["ddp_resnet.py", "spawn"]["result"] == "FAILED (no metrics)"
    assert res.stdout.rstrip().endswith("run_all: 3 of 5 runs FAILED")


def test_an_unknown_option_is_one_line_and_exit_2():
    res = run(["bash", str(ROOT / "run_all.sh"), "--fast"], timeout=30, check=False)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == "run_all: unknown option --fast (see --help)\n"
