"""Shared test helpers: launch the scripts the way a user does, with a hard timeout."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")


def run(args: list, timeout: float, cwd=None, env=None, check=True) -> subprocess.CompletedProcess:
    """Run a command in its own process group; on timeout or exit, kill the whole group
    so no spawned rank or torchrun worker is left behind."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or var not in env:
            full_env.pop(var, None)  # a test never inherits a launcher's rendezvous by accident
    proc = subprocess.Popen(args, cwd=cwd or ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, args))}\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(map(str, args))}\n{out[-3000:]}\n{err[-3000:]}")
    return result


def python(script: str, *flags) -> list:
    return [sys.executable, str(ROOT / script), *map(str, flags)]


def torchrun(script: str, nproc: int, *flags) -> list:
    # `python -m torch.distributed.run` is the torchrun console script, from this interpreter.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(ROOT / script), *map(str, flags)]


def metrics(path) -> dict:
    return json.loads(Path(path).read_text())
