"""ddp_gather.py: every rank's objects and tensors, in rank order, both launch paths."""

import shutil
import time

import pytest

from conftest import (
    ROOT,
    finish,
    finish_all,
    kill_all,
    last_line,
    metrics,
    occupy,
    python,
    run,
    start,
    tagged,
    torchrun,
)


def test_all_gather_object_rank_order(tmp_path):
    """Both launch paths at once, 3 spawned ranks and 2 under torchrun, while another program
    holds the tutorials' port 12355 and torchrun's default 29500: neither path needs them. The
    spawned run has MASTER_PORT exported to the busy 12355, and WORLD_SIZE to 1: a spawned run
    takes a free port of its own, so two runs on one machine never meet, and --nprocs ranks
    (once, the exported WORLD_SIZE won: rank 0 trained alone until the others failed)."""
    held = [occupy(12355), occupy(29500)]
    out = {w: tmp_path / f"{w}.json" for w in (3, 2)}
    copy = shutil.copy(ROOT / "ddp_gather.py", tmp_path / "my_gather.py")  # a user's copy
    cmds = {
        3: python(copy, "--nprocs", 3, "--cpu", "--metrics-out", out[3]),
        2: torchrun("ddp_gather.py", 2, "--cpu", "--metrics-out", out[2]),
    }
    try:
        # the spawned run with MASTER_PORT exported to the busy 12355, and WORLD_SIZE to 1
        procs = [start(cmds[3], env={"MASTER_PORT": "12355", "WORLD_SIZE": "1"}), start(cmds[2])]
        results = dict(zip(cmds, finish_all(procs, 120), strict=True))
    finally:
        for s in held:
            if s:
                s.close()
    for world, res in results.items():
        m = metrics(out[world])
        assert m["world_size"] == world
        assert m["script"] == ("my_gather.py" if world == 3 else "ddp_gather.py")  # its own name
        assert [g["dict"]["rank"] for g in m["gathered"]] == list(range(world))
        assert [g["list"] for g in m["gathered"]] == [[1 + r, 2 + r, 3 + r] for r in range(world)]
        assert [g["tensor"] for g in m["gathered"]] == [[1.0 + r] * 3 for r in range(world)]
        assert f"all_gather: {[[1.0 + r] * 3 for r in range(world)]}" in res.stdout
        assert res.stdout.splitlines()[-1] == f"done | gathered {world} objects | backend gloo"
    # nothing a user would have to read past (torchrun itself warns that it set OMP_NUM_THREADS)
    assert results[3].stderr == ""


def the_ranks_master_port(proc, timeout: float) -> int:
    """MASTER_PORT in the environment a spawned rank started with, as soon as one has."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in tagged(proc.mark):
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:  # it just ended
                continue
            for var in env:
                if var.startswith(b"MASTER_PORT="):
                    return int(var.split(b"=")[1])
        time.sleep(0.01)
    pytest.fail(f"no rank with MASTER_PORT within {timeout}s")


def test_no_other_program_takes_the_port_while_the_ranks_meet():
    """Another program binds the launcher's MASTER_PORT as soon as the ranks are started, while
    rank 0 is still importing torch. The launcher keeps the port bound until the run ends; once
    it only probed it, and a parallel test suite's process took it in that window: rank 0's
    EADDRINUSE ended the run."""
    proc = start(python("ddp_gather.py", "--cpu"))
    taken = None
    try:
        taken = occupy(the_ranks_master_port(proc, 60))
        res = finish(proc, 120, check=False)
    finally:
        kill_all(proc)
        if taken:
            taken.close()
    assert taken is None, "another program took the port before rank 0 had it"
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    "flag, value, kind",
    # an empty --metrics-out ("$OUT", OUT unset) once wrote nothing, and the run passed
    [
        ("--nprocs", 0, "positive"),
        ("--nprocs", "two", "positive"),
        ("--metrics-out", "", "nonempty"),
    ],
)
def test_a_bad_flag_is_one_clear_line(flag, value, kind):
    res = run(python("ddp_gather.py", "--cpu", flag, value), timeout=60, check=False)
    assert res.returncode == 2
    assert last_line(res.stderr) == (
        f"ddp_gather.py: error: argument {flag}: invalid {kind} value: '{value}'"
    )
