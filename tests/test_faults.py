"""When things go wrong: busy ports, dead and hung ranks, debug mode. CPU, gloo, loopback only."""
import os
import signal
import socket
import time

import pytest

from conftest import finish, python, run, start, tagged, torchrun

FM = ["--cpu", "--synthetic", "--timeout", "10"]


def listening_ports() -> dict:
    """{port: local address} of TCP sockets in LISTEN state, from /proc/net/tcp and tcp6."""
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":
                    addr, port = local.split(":")
                    ports[int(port, 16)] = addr
    return ports


def children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def wait_for_ranks(proc, count: int, under_torchrun: bool, timeout: float = 60) -> list:
    """The rank processes of a run once they exist (mp.spawn adds a resource tracker, skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = children(proc.pid)
        if not under_torchrun:
            ranks = [p for p in ranks if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        if len(ranks) == count:
            return ranks
        time.sleep(0.2)
    pytest.fail(f"the run never had {count} ranks")


def occupy(port: int):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        s.listen()
        return s
    except OSError:  # taken already: just as good for this test
        s.close()
        return None


def test_busy_default_ports_and_two_runs_at_once(tmp_path):
    held = [occupy(12355), occupy(29500)]
    try:
        procs = [start(python("ddp_gather.py", "--cpu", "--metrics-out", tmp_path / "a.json")),
                 start(python("ddp_gather.py", "--cpu", "--metrics-out", tmp_path / "b.json")),
                 start(python("ddp_fashionmnist.py", *FM, "--epochs", 1, "--max-steps", 5)),
                 start(torchrun("ddp_gather.py", 2, "--cpu"))]
        for proc in procs:
            finish(proc, timeout=180)
    finally:
        for s in held:
            if s:
                s.close()


def test_master_port_from_the_environment_is_used(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start(python("ddp_fashionmnist.py", *FM, "--epochs", 3), env={"MASTER_PORT": str(port)})
    deadline, seen = time.monotonic() + 60, None
    while seen is None and time.monotonic() < deadline and proc.poll() is None:
        seen = listening_ports().get(port)
        time.sleep(0.1)
    finish(proc, timeout=180)
    assert seen is not None, f"nothing listened on MASTER_PORT {port} during the run"


def test_busy_master_port_is_one_clear_error():
    s = occupy(0)
    port = s.getsockname()[1]
    try:
        res = run(python("ddp_gather.py", "--cpu"), timeout=60, check=False, env={"MASTER_PORT": str(port)})
    finally:
        s.close()
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        f"error: MASTER_PORT={port} cannot be used here (Address already in use); unset it and a free port is picked"]


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_killed_rank_ends_the_job_within_seconds(launcher):
    flags = [*FM, "--epochs", 100]
    proc = start(python("ddp_fashionmnist.py", "--nprocs", 2, *flags) if launcher == "spawn"
                 else torchrun("ddp_fashionmnist.py", 2, *flags))
    victim = wait_for_ranks(proc, 2, launcher == "torchrun")[1]
    time.sleep(3)  # into training
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    res = finish(proc, timeout=60, check=False)  # also fails if any process is left
    assert res.returncode != 0
    assert time.monotonic() - killed < 15
    if launcher == "spawn":
        assert "error: rank 1 was killed by SIGKILL; the other ranks were stopped" in res.stderr


@pytest.mark.parametrize("launcher,margin", [("spawn", 15), ("torchrun", 40)])
def test_hung_rank_ends_the_job_after_the_timeout(launcher, margin):
    """A stopped rank never reaches the next collective: the others give up after --timeout."""
    flags = [*FM, "--epochs", 100]
    proc = start(python("ddp_fashionmnist.py", "--nprocs", 2, *flags) if launcher == "spawn"
                 else torchrun("ddp_fashionmnist.py", 2, *flags))
    victim = wait_for_ranks(proc, 2, launcher == "torchrun")[1]
    time.sleep(3)
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    res = finish(proc, timeout=120, check=False)
    took = time.monotonic() - stopped
    assert res.returncode != 0
    assert 10 <= took < 10 + margin, took
    assert "Timed out" in res.stderr or "timed out" in res.stderr


@pytest.mark.parametrize("nprocs", [0, -2])
def test_non_positive_nprocs_is_one_clear_error(nprocs):
    res = run(python("ddp_fashionmnist.py", "--cpu", "--synthetic", "--nprocs", nprocs), timeout=60, check=False)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [f"error: --nprocs must be at least 1, got {nprocs}"]


@pytest.mark.parametrize("cmd", [
    ["ddp_gather.py", "--cpu"],
    ["ddp_fashionmnist.py", *FM, "--epochs", 1, "--max-steps", 5],
])
def test_scripts_pass_with_distributed_debug_detail(cmd):
    res = run(python(*cmd), timeout=180, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert "done |" in res.stdout or "gathered" in res.stdout
