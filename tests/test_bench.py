"""run_all.sh --bench: the DataParallel vs DDP images/s table, in its tiny CPU version (gloo,
resnet18 at 32 px, DDP on 1 and 2 processes, dp_resnet.py --cpu the baseline), the images/s of
each run's 2nd epoch as its metrics give them, and its handling of failed runs."""

import math
import re
import shutil
import sys
from pathlib import Path

import torch
import torchvision

from conftest import ROOT, metrics, run

COLUMNS = ["n", "mode", "precision", "ips", "scaling", "vs_dp"]
HEADER = "| processes | mode | precision | images/s | scaling vs 1 | DDP/DP |"


def bench(folder, timeout: float, *flags, cwd=ROOT, check=True):
    env = {"RUNS_DIR": str(folder), "PYTHON": sys.executable, "RUN_TIMEOUT": "120"}
    cmd = ["bash", str(cwd / "run_all.sh"), "--bench", *flags]
    return run(cmd, timeout=timeout, cwd=cwd, check=check, env=env)


def bench_table(text: str) -> dict:
    """The rows of the one Markdown table under HEADER by (n, mode), as dicts of cells."""
    lines = text.splitlines()
    assert lines.count(HEADER) == 1, text
    first = lines.index(HEADER)
    assert lines[first + 1] == "| ---: | --- | --- | ---: | ---: | ---: |"
    rows = {}
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[int(cells[0]), cells[1]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def positive(cell: str) -> float:
    value = float(cell)  # raises on FAILED, "-" or any other text
    assert math.isfinite(value) and value > 0, cell
    return value


def rounds_to(cell: str, value: float, places: int) -> bool:
    """A cell shows `value` to `places` decimals: within half its last digit, whichever way a
    value on the boundary (or computed in another order) was rounded."""
    return positive(cell) > 0 and abs(float(cell) - value) <= 0.5 * 10**-places * (1 + 1e-9)


def own_folder(stdout: str) -> Path:
    line = next(x for x in stdout.splitlines() if x.startswith("run_all: logs, metrics"))
    return Path(line.split(" in ", 1)[1])


def test_bench_on_cpu_prints_a_table_of_measured_figures(tmp_path):
    res = bench(tmp_path, 240)  # about 40 s on 2 cores
    versions = f"torch {torch.__version__} | torchvision {torchvision.__version__}"
    head = r"bench \| CPU: .+, \d+ cores \| resnet18, 32 px, batch 8 per process of \d+ thread"
    assert re.search(rf"^{head}.* \| {re.escape(versions)}$", res.stdout, re.M), res.stdout
    rows = bench_table(res.stdout)
    assert list(rows) == [(1, "ddp"), (1, "dp"), (2, "ddp")]
    out = own_folder(res.stdout)
    ips = {}  # unrounded, from the metrics: the ratios below are of these, not of the cells
    for (n, mode), row in rows.items():
        assert row["precision"] == "fp32"  # no bf16 on CPU
        m = metrics(out / f"{mode}_resnet_{n}_fp32.json")
        assert m["epochs_run"] == 2 and m["steps"] == 10  # the 2nd epoch's figure, warm
        ips[n, mode] = m["images_per_sec"]
        assert rounds_to(row["ips"], ips[n, mode], 1)
    assert rows[1, "dp"]["scaling"] == rows[1, "ddp"]["scaling"] == "1.00"
    assert rounds_to(rows[2, "ddp"]["scaling"], ips[2, "ddp"] / 2 / ips[1, "ddp"], 2)
    assert rounds_to(rows[1, "ddp"]["vs_dp"], ips[1, "ddp"] / ips[1, "dp"], 2)
    assert rows[1, "dp"]["vs_dp"] == rows[2, "ddp"]["vs_dp"] == "-"  # no DataParallel on 2
    saved = (out / "bench.md").read_text()
    assert saved.startswith("bench | CPU: ") and bench_table(saved) == rows
    assert not list(out.rglob("*.pt"))  # its checkpoints are gone
    assert res.stdout.rstrip().endswith("run_all: all 3 runs passed")


STANDIN = """import json, sys
from pathlib import Path
args = sys.argv[1:]
with open(__file__ + ".args", "a") as f:
    print(*args, file=f)
ckpt = Path(args[args.index("--ckpt-dir") + 1])
assert not list(ckpt.glob("epoch_*.pt")), "a used checkpoint folder"
ckpt.mkdir(parents=True, exist_ok=True)
(ckpt / "epoch_1.pt").touch()
def done(ips):
    json.dump({"images_per_sec": ips}, open(args[args.index("--metrics-out") + 1], "w"))
"""


def test_bench_shows_failed_runs_and_exits_non_zero(tmp_path):
    shutil.copy(ROOT / "run_all.sh", tmp_path)
    (tmp_path / "dp_resnet.py").write_text(STANDIN + "done(40.0)\n")
    # ddp: 2 processes crash; 1 process writes its figure
    (tmp_path / "ddp_resnet.py").write_text(
        STANDIN + "if args[args.index('--nprocs') + 1] == '2':\n    sys.exit('boom')\ndone(30.0)\n"
    )
    res = bench(tmp_path / "runs", 60, "--bench-batch", "4", cwd=tmp_path, check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    rows = bench_table(res.stdout)
    assert rows[1, "dp"] == dict(
        n="1", mode="dp", precision="fp32", ips="40.0", scaling="1.00", vs_dp="-"
    )
    assert (rows[1, "ddp"]["ips"], rows[1, "ddp"]["vs_dp"]) == ("30.0", "0.75")
    assert rows[2, "ddp"]["ips"] == "FAILED (exit 1)" and rows[2, "ddp"]["scaling"] == "-"
    assert "boom" in res.stdout  # the failed run's last lines
    assert res.stdout.rstrip().endswith("run_all: 1 of 3 runs FAILED")
    assert bench_table((own_folder(res.stdout) / "bench.md").read_text()) == rows
    # what each run got: the batch, the CPU, no workers (and, above, an empty checkpoint folder)
    dp_args = (tmp_path / "dp_resnet.py.args").read_text()
    assert dp_args.startswith("--batch-size 4 --cpu --arch resnet18 --image-size 32 --workers 0")
    ddp_args = (tmp_path / "ddp_resnet.py.args").read_text().splitlines()
    assert [a.split()[:4] for a in ddp_args] == [["--nprocs", n, "--batch-size", "4"] for n in "12"]


def test_help_names_the_modes():
    res = run(["bash", str(ROOT / "run_all.sh"), "--help"], timeout=30)
    assert res.stdout.startswith("Run every script of the collection once")
    assert all(flag in res.stdout for flag in ("--full", "--bench", "--bench-batch", "RUNS_DIR"))
    res = run(["bash", str(ROOT / "run_all.sh"), "--bench-batch", "0"], timeout=30, check=False)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
