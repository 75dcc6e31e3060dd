"""run_all.sh: runs every script, prints one summary table, fails when a run fails."""
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
    shutil.copy(ROOT / "ddp_gather.py", tmp_path)
    (tmp_path / "ddp_fashionmnist.py").write_text("import sys\nsys.exit('boom')\n")
    res = run(["bash", str(tmp_path / "run_all.sh")], timeout=300, cwd=tmp_path, check=False,
              env={"RUNS_DIR": str(tmp_path / "runs")})
    assert res.returncode == 1
    rows = table_rows(res.stdout)
    assert len(rows) == 3  # gather twice, fashionmnist once; the ResNets are absent here
    assert "FAILED (exit 1)" in next(r for r in rows if "ddp_fashionmnist.py" in r)
    assert all("| ok: " in r for r in rows if "ddp_gather.py" in r)
    assert "1 run(s) FAILED" in res.stdout
