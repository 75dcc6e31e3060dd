"""Soak: DataLoader worker starts from ranks that already run gloo's threads, with one core busy,
and a stack dump of every process of a run that stalls. Not part of the suite (minutes long).

    python tests/soak_workers.py RUNS [EPOCHS]     # py-spy on PATH for the dumps

Each run: torchrun, 2 ranks, ddp_resnet.py (resnet18, 32 px) with EPOCHS one-step epochs
(default 40) and 2 workers per rank, through tests/recorded.py, which counts the workers each
DataLoader started. A run whose log does not grow for STALL seconds is a stall: py-spy dumps
each of its processes into stall_N.txt, then the run is killed. One line per run, then a total.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from conftest import MARK, ROOT, TINY, tagged, torchrun

STALL = 20  # an epoch takes about half a second here


def soak_run(i: int, epochs: int, folder: Path) -> tuple:
    flags = [*TINY, "--batch-size", 4, "--max-steps", 1, "--workers", 2]
    flags += ["--epochs", epochs, "--timeout", 120, "--ckpt-dir", folder / f"ckpt{i}"]
    log, mark = folder / f"run{i}.log", uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "CUDA_VISIBLE_DEVICES": ""}
    cmd = torchrun("tests/recorded.py", 2, folder / f"rec{i}", ROOT / "ddp_resnet.py", *flags)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    began, size, grew = time.monotonic(), 0, time.monotonic()
    while proc.poll() is None:
        time.sleep(0.5)
        if log.stat().st_size != size:
            size, grew = log.stat().st_size, time.monotonic()
        elif time.monotonic() - grew > STALL:
            dumps = [
                subprocess.run(["py-spy", "dump", "--pid", str(p)], capture_output=True, text=True)
                for p in tagged(mark)
            ]
            Path(f"stall_{i}.txt").write_text(log.read_text() + "\n".join(d.stdout for d in dumps))
            for p in tagged(mark):
                os.kill(p, signal.SIGKILL)
            return "STALL", time.monotonic() - began, 0
    seconds = time.monotonic() - began
    started = sum(sum(json.loads(f.read_text())["workers"]) for f in folder.glob(f"rec{i}.*.json"))
    if proc.returncode:
        Path(f"failed_{i}.txt").write_text(log.read_text())
    return f"exit {proc.returncode}", seconds, started


if __name__ == "__main__":
    runs, epochs = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core taken
    folder, total, stalls, failed = Path(tempfile.mkdtemp()), 0, 0, 0
    try:
        for i in range(runs):
            status, seconds, started = soak_run(i, epochs, folder)
            total, stalls = total + started, stalls + (status == "STALL")
            failed += status not in ("exit 0", "STALL")
            print(f"run {i}: {status} | {seconds:.1f} s | {started} worker starts", flush=True)
    finally:
        busy.kill()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"soak: {runs} runs, {total} worker starts, {stalls} stalls, {failed} other failures")
    sys.exit(1 if stalls or failed else 0)
