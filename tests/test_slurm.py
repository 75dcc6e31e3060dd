"""On a SLURM cluster: the sbatch recipe of docs/cluster.md trains and writes its checkpoints. A
real SLURM (slurmctld, slurmd, munged on this
machine, loopback only) started by the `slurm` fixture of tests/slurm.py."""

import os
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY, metrics, run
from slurm import slurm  # noqa: F401 (the fixture)


def client_env(slurm, **more) -> dict:
    # the venv's torchrun and python for the job, as for a user who submits with it active
    return {
        **slurm.env,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **more,
    }


def ended(job: str, env: dict, timeout: float) -> tuple:
    """A submitted job's final state and exit code, looked up twice a second (sbatch --wait
    backs off to 10 s between its looks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = run(["scontrol", "show", "job", job], timeout=30, env=env).stdout
        state = re.search(r"JobState=(\S+)", info).group(1)
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state, re.search(r"ExitCode=(\S+)", info).group(1)
        time.sleep(0.5)
    run(["scancel", job], timeout=30, env=env)
    pytest.fail(f"job {job} still {state} after {timeout} s")


def test_the_sbatch_recipe_trains_on_every_node(slurm, tmp_path):
    """The recipe, unchanged from docs/cluster.md, on CPU: one torchrun per node, c10d rendezvous on
    the first node, checkpoints in CKPT_DIR."""
    recipe = re.search(
        r"```bash\n(#!/bin/bash\n.*?)```", (ROOT / "docs" / "cluster.md").read_text(), re.S
    )
    job = tmp_path / "ddp_resnet.sbatch"
    job.write_text(recipe.group(1))
    nodes, ckpt = len(slurm.nodes), tmp_path / "ckpt"
    env = client_env(slurm, CKPT_DIR=str(ckpt))
    res = run(
        [
            str(a)
            for a in [
                "sbatch",
                "--parsable",
                f"--nodes={nodes}",
                f"--cpus-per-task={max(1, os.cpu_count() // nodes)}",
                f"--output={tmp_path}/job.out",
                job,
                *TINY,
                "--batch-size",
                4,
                "--epochs",
                2,
                "--max-steps",
                2,
                "--timeout",
                60,
                "--metrics-out",
                tmp_path / "m.json",
            ]
        ],
        timeout=60,
        env=env,
    )
    state = ended(res.stdout.strip().split(";")[0], env, timeout=300)
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert state == ("COMPLETED", "0:0"), out
    m = metrics(tmp_path / "m.json")
    assert m["world_size"] == nodes * max(1, os.cpu_count() // nodes) and m["epochs_run"] == 2
    assert sorted(p.name for p in ckpt.glob("epoch_*.pt")) == ["epoch_1.pt", "epoch_2.pt"]
    assert re.search(r"^done \| epochs_run 2 \|", out, re.M), out
