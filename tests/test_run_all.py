"""run_all.sh: runs every script, prints one summary table, fails when a run fails, leaves no
process behind, and writes into a folder of its own: two calls at once in one RUNS_DIR keep
their own rows, and a user's files there stay as they were."""

import os
import shutil
import signal
import sys
import time
from pathlib import Path

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
# stand-ins that pass at once, with the metrics each real script writes
FM = METRICS + "json.dump({'test_accuracy': 0.5, 'final_loss': 1.0}, open(out, 'w'))\n"
RESNET = FRESH + METRICS + "json.dump({'images_per_sec': 9.0, 'final_loss': 2.0}, open(out, 'w'))\n"


def start_run_all(cwd, runs, env=None):
    """bash run_all.sh in `cwd`, with its logs, metrics and checkpoints under `runs`."""
    env = {"RUNS_DIR": str(runs), "PYTHON": sys.executable, **(env or {})}
    return start(["bash", str(cwd / "run_all.sh")], cwd=cwd, env=env)


def own_folder(stdout: str):
    """The folder a call of run_all.sh wrote into, as its last lines say."""
    line = next(x for x in stdout.splitlines() if x.startswith("run_all: logs, metrics"))
    return Path(line.split(" in ", 1)[1])


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
    out = own_folder(res.stdout)
    assert out.parent == tmp_path
    dp = metrics(out / "dp_resnet_single_1.json")
    ips, loss = dp["images_per_sec"], dp["final_loss"]
    assert (
        rows["dp_resnet.py", "single"]["result"]
        == f"ok: images_per_sec {ips:.4g}, final_loss {loss:.4g}"
    )
    assert res.stdout.rstrip().endswith("run_all: all 5 runs passed")
    for script in ("dp_resnet", "ddp_resnet"):  # each run's checkpoints, in a folder of its own
        assert sorted(p.name for p in (out / f"{script}.ckpt").iterdir()) == [
            "epoch_1.pt",
            "epoch_2.pt",
        ]


def test_two_calls_at_once_in_one_runs_dir_keep_their_own_rows_and_the_users_files(tmp_path):
    """Two calls at once in a RUNS_DIR that holds a user's own ckpt/ and runs.tsv: each call
    writes into a new folder of its own, its table has its own rows alone, and the user's files
    stay as they were (once, run_all.sh deleted RUNS_DIR/ckpt and emptied RUNS_DIR/runs.tsv,
    and two calls printed each other's rows). The second call starts in the folder above,
    with RUNS_DIR relative to it (once, taken from run_all.sh's folder). In one call, a run
    that fails, one that writes no metrics and one whose launcher is killed (its ranks must go
    too) each fail their row, and the others still run; exit 1. Stand-ins, quick, except the
    FashionMNIST run, whose launcher is killed."""
    runs = tmp_path / "runs"
    (runs / "ckpt").mkdir(parents=True)
    (runs / "ckpt" / "epoch_1.pt").write_bytes(b"the user's")
    (runs / "runs.tsv").write_text("the user's\n")
    failing, passing = tmp_path / "failing", tmp_path / "passing"
    copy_with(failing, ddp_gather=GATHER, ddp_fashionmnist=None)
    # dp_resnet.py fails, ddp_resnet.py exits 0 but writes no metrics
    copy_with(failing, dp_resnet=FRESH + "sys.exit('boom')\n", ddp_resnet=FRESH)
    copy_with(passing, ddp_gather=GATHER, ddp_fashionmnist=FM, dp_resnet=RESNET, ddp_resnet=RESNET)
    # the second from the folder above, its RUNS_DIR relative to it (once, to run_all.sh's)
    second = start(
        ["bash", passing / "run_all.sh"], tmp_path, {"RUNS_DIR": "runs", "PYTHON": sys.executable}
    )
    procs = [start_run_all(failing, runs), second]
    kill_the_launcher(procs[0], "ddp_fashionmnist.py")
    res = finish(procs[0], timeout=180, check=False)  # fails if any rank outlived its launcher
    ok = finish(procs[1], timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    rows = table(res.stdout)
    assert len(rows) == 5  # this call's rows alone (table() refuses a row twice)
    for launch in ("spawn", "torchrun"):
        assert rows["ddp_gather.py", launch]["result"] == "ok: gathered ranks [0, 1]"
    assert rows["ddp_fashionmnist.py", "spawn"]["result"] == "FAILED (exit 137)"
    assert rows["dp_resnet.py", "single"]["result"] == "FAILED (exit 1)"  # went on
    assert "boom" in res.stdout  # the failed run's last lines
    assert "a used checkpoint folder" not in res.stdout
    assert rows["ddp_resnet.py", "spawn"]["result"] == "FAILED (no metrics)"
    assert res.stdout.rstrip().endswith("run_all: 3 of 5 runs FAILED")
    rows = table(ok.stdout)
    assert len(rows) == 5 and all(r["result"].startswith("ok: ") for r in rows.values()), rows
    assert ok.stdout.rstrip().endswith("run_all: all 5 runs passed")
    assert own_folder(res.stdout) != own_folder(ok.stdout)
    assert own_folder(res.stdout).parent == own_folder(ok.stdout).parent == runs
    assert (runs / "ckpt" / "epoch_1.pt").read_bytes() == b"the user's"
    assert (runs / "runs.tsv").read_text() == "the user's\n"


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--fast"], "unknown option --fast (see --help)"),
        (["--bench-batch", 4], "--bench-batch goes with --bench"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(flags, why):
    res = run(["bash", str(ROOT / "run_all.sh"), *map(str, flags)], timeout=30, check=False)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == f"run_all: {why}\n"
