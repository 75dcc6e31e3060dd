"""run_all.sh: runs every script, prints one summary table, fails when a run fails."""
import os
import shutil

from conftest import DEBIAN_FMNIST, ROOT, run

SCRIPTS = ["ddp_gather.py", "ddp_fashionmnist.py", "dp_resnet.py", "ddp_resnet.py"]


def table_rows(stdout: str) -> list:
    return [line for line in stdout.splitlines() if line.startswith("| ") and ".py" in line]


def test_run_all_passes_and_names_every_script(tmp_path):
    res = run(["bash", str(ROOT / "run_all.sh")], timeout=600, env={"RUNS_DIR": str(tmp_path)})
    rows = table_rows(res.stdout)
    for script in SCRIPTS:
        assert any(row.startswith(f"| {script} ") and "| ok: " in row for row in rows), res.stdout
    assert "ddp_gather.py        | torchrun" in res.stdout
    fm = next(row for row in rows if row.startswith("| ddp_fashionmnist.py"))
    if DEBIAN_FMNIST.is_dir():
        assert "real data" in fm and "test_accuracy" in fm
    assert res.stdout.rstrip().endswith(f"all {len(rows)} runs passed")


def test_run_all_keeps_going_and_fails_when_a_run_fails(tmp_path):
    shutil.copy(ROOT / "run_all.sh", tmp_path)
    # stand-ins: a gather that writes its metrics at once, a FashionMNIST that fails
    (tmp_path / "ddp_gather.py").write_text(
        "import json, sys\nout = sys.argv[sys.argv.index('--metrics-out') + 1]\n"
        "json.dump({'world_size': 2, 'gathered': [{'dict': {'rank': 0}}, {'dict': {'rank': 1}}]}, open(out, 'w'))\n")
    (tmp_path / "ddp_fashionmnist.py").write_text("import sys\nsys.exit('boom')\n")
    # and an nvidia-smi that lists a GPU torch cannot see (as a torch built for a newer driver)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    res = run(["bash", str(tmp_path / "run_all.sh")], timeout=300, cwd=tmp_path, check=False,
              env={"RUNS_DIR": str(tmp_path / "runs"), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert res.returncode == 1
    assert res.stderr.startswith("run_all: nvidia-smi lists GPUs, torch ") and "; on CPU\n" in res.stderr
    rows = table_rows(res.stdout)
    assert len(rows) == 3  # gather twice, fashionmnist once; the ResNets are absent here
    assert "FAILED (exit 1)" in next(r for r in rows if "ddp_fashionmnist.py" in r)
    assert all("| ok: gathered 2 objects in rank order: True" in r for r in rows if "ddp_gather.py" in r)
    assert "1 run(s) FAILED" in res.stdout


def test_a_killed_run_fails_the_runner_and_leaves_no_process(tmp_path):
    """SIGKILL the launcher process of one run: its ranks must go too, and run_all.sh exits 1."""
    import os
    import signal
    import time

    from conftest import finish, start, tagged
    shutil.copy(ROOT / "run_all.sh", tmp_path)
    shutil.copy(ROOT / "ddp_fashionmnist.py", tmp_path)
    proc = start(["bash", str(tmp_path / "run_all.sh")], cwd=tmp_path, env={"RUNS_DIR": str(tmp_path / "runs")})
    deadline, launcher = time.monotonic() + 120, None
    while launcher is None and time.monotonic() < deadline:
        for pid in tagged(proc.mark):  # this run's processes only
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if len(cmdline) > 1 and cmdline[1] == b"ddp_fashionmnist.py":  # the launcher, not `timeout`
                ranks = open(f"/proc/{pid}/task/{pid}/children").read().split()
                if len(ranks) >= 2:  # the resource tracker and at least one rank
                    launcher = int(pid)
        time.sleep(0.2)
    assert launcher, "the FashionMNIST run never started its ranks"
    time.sleep(2)
    os.kill(launcher, signal.SIGKILL)
    res = finish(proc, timeout=180, check=False)  # fails if any rank outlived its launcher
    assert res.returncode == 1
    assert "FAILED (exit 137)" in next(r for r in table_rows(res.stdout) if "ddp_fashionmnist.py" in r)
