"""run_all.sh --bench: the DataParallel vs DDP images/s table, in its tiny CPU version (gloo,
resnet18 at 32 px, 1 and 2 processes, both precisions), and its handling of failed runs."""
import json
import math
import re
import shutil
import sys

import torch
import torchvision

from conftest import ROOT, run

HEADER = "| GPUs | mode | precision | images/s | scaling vs 1 GPU | DDP / DP | peak mem/GPU (GiB) |"
COLUMNS = ["gpus", "mode", "precision", "ips", "scaling", "vs_dp", "mem"]
PRECISIONS = {"default": "default", "amp + channels-last": "amp"}  # table label -> file tag
CPU_ROWS = {(n, mode, "default") for n, mode in [(1, "plain"), (1, "ddp"), (2, "ddp")]}  # no bf16 on CPU


def bench_table(text: str) -> list:
    """The rows of the one Markdown table under HEADER, as dicts of stripped cells."""
    lines = text.splitlines()
    assert lines.count(HEADER) == 1, text
    start = lines.index(HEADER)
    assert re.fullmatch(r"\|( -{3,}:? \|){7}", lines[start + 1]), lines[start + 1]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), line
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def positive(cell: str) -> float:
    value = float(cell)  # raises on FAILED, "-" or any other text
    assert math.isfinite(value) and value > 0, cell
    return value


def bench(folder, timeout: float, check=True, cwd=None):
    return run(["bash", str((cwd or ROOT) / "run_all.sh"), "--bench"], timeout=timeout, cwd=cwd, check=check,
               env={"RUNS_DIR": str(folder), "PYTHON": sys.executable, "RUN_TIMEOUT": "120"})


def test_bench_on_cpu_prints_a_measured_table(tmp_path):
    res = bench(tmp_path, timeout=240)  # about 50 s on 2 idle cores
    assert res.returncode == 0
    out = res.stdout
    assert re.search(rf"^bench \| CPU: .+, \d+ cores, no GPU, \d+ thread\(s\) per process \| "
                     rf"torch {re.escape(torch.__version__)} \| "
                     rf"torchvision {re.escape(torchvision.__version__)} \| .*--arch resnet18", out, re.M), out
    rows = bench_table(out)
    measured = {}
    for row in rows:
        m = re.fullmatch(r"([12]) \(CPU\)", row["gpus"])
        assert m, row  # CPU figures are labelled as such
        n, mode, prec = int(m[1]), row["mode"], row["precision"]
        # every figure is a positive number, and the one its run measured and wrote
        positive(row["ips"])
        metrics = json.loads((tmp_path / f"bench_{mode}_x{n}_{PRECISIONS[prec]}.json").read_text())
        assert row["ips"] == f"{metrics['images_per_sec']:.1f}"
        measured[n, mode, prec] = metrics["images_per_sec"]
        assert metrics["device"] == "cpu" and metrics["world_size"] == n and metrics["steps"] == 8
        if mode == "plain":
            assert metrics["script"] == "dp_resnet.py" and metrics["wrapper"] is None
        else:
            assert metrics["script"] == "ddp_resnet.py" and metrics["backend"] == "gloo"
        # no DataParallel on CPU, so no DDP / DP ratio; no GPU memory
        assert row["vs_dp"] == ("n/a" if mode == "ddp" else "-") and row["mem"] == "-"
    assert len(rows) == len(CPU_ROWS) and set(measured) == CPU_ROWS
    for row, (n, mode, prec) in zip(rows, measured):  # scaling: images/s / (N x the same at N = 1)
        assert positive(row["scaling"]) == round(measured[n, mode, prec] / (n * measured[1, mode, prec]), 2)
    assert "scaling vs 1 GPU = images/s / (N x images/s of the same mode and precision at N = 1)" in out
    assert re.search(r"^CPU: .*compare with no GPU figure.*says nothing about GPUs", out, re.M)
    assert re.search(r"DDP on 1 process / plain: default \d+\.\d\d\.", out)
    saved = (tmp_path / "bench.md").read_text()
    assert bench_table(saved) == rows and saved.startswith("bench | CPU: ")
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.glob("bench_ckpt.*"))  # checkpoints removed
    assert out.rstrip().endswith(f"bench table saved to {tmp_path / 'bench.md'}")


def test_bench_shows_failed_runs_and_exits_non_zero(tmp_path):
    shutil.copy(ROOT / "run_all.sh", tmp_path)
    # plain: a stand-in that reports a figure at once; ddp: 1 process measures nothing, 2 crash
    write = "json.dump({out}, open(sys.argv[sys.argv.index('--metrics-out') + 1], 'w'))"
    (tmp_path / "dp_resnet.py").write_text(
        "import json, sys\n" + write.format(out={"images_per_sec": 12.5, "max_memory_gib": None}) + "\n")
    (tmp_path / "ddp_resnet.py").write_text(
        "import json, sys\nif sys.argv[sys.argv.index('--nprocs') + 1] == '2':\n    sys.exit('boom')\n"
        + write.format(out={"images_per_sec": None}) + "\n")
    res = bench(tmp_path / "runs", timeout=120, check=False, cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    rows = {(r["gpus"], r["mode"], PRECISIONS[r["precision"]]): r for r in bench_table(res.stdout)}
    assert len(rows) == 3
    for prec in ["default"]:
        assert rows["1 (CPU)", "plain", prec]["ips"] == "12.5"
        assert rows["1 (CPU)", "ddp", prec]["ips"] == "FAILED (no images/s in its metrics)"
        assert rows["2 (CPU)", "ddp", prec]["ips"] == "FAILED (exit 1)"
        assert rows["2 (CPU)", "ddp", prec]["scaling"] == "-"
    assert "boom" in res.stdout  # the failed run's last lines
    assert "2 run(s) FAILED" in res.stdout
    assert (tmp_path / "runs" / "bench.md").is_file()


def test_help_mentions_bench():
    res = run(["bash", str(ROOT / "run_all.sh"), "--help"], timeout=30)
    assert "--bench" in res.stdout and "--bench-batch" in res.stdout
