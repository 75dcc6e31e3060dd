"""A real single-host SLURM cluster (munged + slurmctld + slurmd) for one test session.

Use it with `from slurm import slurm` in a test module, then run clients with the cluster's env:
`subprocess.run(["srun", "-n", "2", "hostname"], env={**os.environ, **slurm.env})`.
Everything (config, munge key/socket, state, spool, logs) lives in a temp dir and nothing in
/etc is read or written; every daemon is stopped by PID at the end of the session.
"""

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import unavailable

SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # daemons live in sbin
NODES = 2  # two slurmd on one host (slurmd -N NAME, each its own Port): a two-node cluster


@dataclass
class Slurm:
    env: dict  # add to a client's environment: srun/sbatch/squeue then use this cluster
    hostname: str  # SlurmctldHost, and the first node's name
    nodes: list  # node names
    tmp: Path  # config, state, spool and logs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp: Path, host: str, nodes: list, munge_socket: Path) -> str:
    user = getpass.getuser()
    lines = [
        "ClusterName=pytest",
        f"SlurmctldHost={host}(127.0.0.1)",  # loopback only
        # Non-default ports: no clash with a real cluster or a parallel session.
        f"SlurmctldPort={_free_port()}",  # and each node's Port below
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        # Bind to the address the hostname resolves to (127.0.0.1), not to 0.0.0.0.
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
        # Our own munged; this line is read by the daemons and by srun/sbatch/squeue alike.
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={tmp}/state",
        f"SlurmdSpoolDir={tmp}/spool/%n",
        f"SlurmctldPidFile={tmp}/slurmctld.pid",
        f"SlurmdPidFile={tmp}/slurmd-%n.pid",
        f"SlurmctldLogFile={tmp}/slurmctld.log",
        f"SlurmdLogFile={tmp}/slurmd-%n.log",
        # No cgroups, systemd or database in a sandbox: plugins that need none of them.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",  # memory is not scheduled
        "MailProg=/bin/true",  # Debian's default mail program is absent: slurmctld complains
        "ReturnToService=2",  # a node marked DOWN (slurmd restarted, say) is back on registering
        "KillWait=5",  # SIGKILL a cancelled job's tasks 5 s after SIGTERM, not 30: quick teardown
    ]
    for name in nodes:
        lines.append(
            f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={host} Port={_free_port()} "
            f"CPUs={os.cpu_count()} RealMemory=1024 State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _ours(tmp: Path) -> set:
    """PIDs of this cluster: those whose environment names its slurm.conf (daemons, srun/sbatch
    clients, job tasks), those holding a file in tmp open (slurmstepd double-forks away from
    slurmd and wipes its environment, but keeps slurmd's log open), and their descendants."""
    pids, parent, mark = set(), {}, f"SLURM_CONF={tmp}/slurm.conf\0".encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent[int(entry)] = int(
                Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
            )
            if mark in Path(f"/proc/{entry}/environ").read_bytes() or any(
                os.readlink(f"/proc/{entry}/fd/{fd}").startswith(f"{tmp}/")
                for fd in os.listdir(f"/proc/{entry}/fd")
            ):
                pids.add(int(entry))
        except OSError:
            pass
    grown = True
    while grown:
        new = {p for p, pp in parent.items() if pp in pids} - pids
        pids |= new
        grown = bool(new)
    return pids - {os.getpid()}


def _logs(tmp: Path) -> str:
    # In the foreground the daemons log everything to stderr too, early config errors included.
    return "\n".join(
        f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-20:])
        for f in sorted(tmp.glob("*.stderr"))
    )


def _give_up(reason: str, tmp: Path):
    # In CI a cluster that will not start is a failure, with the daemons' logs; else a skip.
    unavailable(f"SLURM cluster: {reason}", _logs(tmp))


def _stop(procs: list, tmp: Path) -> None:
    """Stop the daemons one by one, last started first (munged last: the others need it to
    shut down cleanly): SIGTERM, SIGKILL after 5 s. Then kill every other process of the
    cluster (slurmstepd, job tasks, clients a test left behind)."""
    for p in reversed(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    deadline = time.monotonic() + 10
    while (left := _ours(tmp)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    assert not left, f"SLURM processes outlived the cluster: {sorted(left)}"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname()
    nodes = [host] + [f"{host}-{i}" for i in range(2, NODES + 1)]
    bins = {
        b: shutil.which(b, path=SBIN)
        for b in ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "scancel")
    }
    if None in bins.values():
        _give_up(f"missing {[b for b, p in bins.items() if p is None]}", tmp)

    key, munge_socket, conf = tmp / "munge.key", tmp / "munge.sock", tmp / "slurm.conf"
    # munged refuses a key others can read; any 32+ random bytes make a key (mungekey writes 128).
    key.touch(mode=0o600)
    key.write_bytes(os.urandom(128))
    (tmp / "state").mkdir()
    for name in nodes:
        (tmp / "spool" / name).mkdir(parents=True)  # slurmd does not create its %n spool dir
    conf.write_text(_config(tmp, host, nodes, munge_socket))
    env = {"SLURM_CONF": str(conf)}
    daemon_env = {**os.environ, **env}

    procs = []

    def daemon(name: str, *args):
        # Foreground (-F/-D) so the PID we hold is the daemon's; own process group so one
        # killpg reaches its helpers (slurmctld's slurmscriptd) and a Ctrl-C of pytest does not.
        with open(tmp / f"{name}.stderr", "w") as err:
            procs.append(
                subprocess.Popen(
                    [*args],
                    env=daemon_env,
                    stdin=subprocess.DEVNULL,
                    stdout=err,
                    stderr=err,
                    start_new_session=True,
                )
            )

    try:
        # --force: munged refuses a socket in a dir not everyone can enter, and pytest's temp
        # dirs are 0700. In the foreground it logs to stderr (no --log-file).
        daemon(
            "munged",
            bins["munged"],
            "-F",
            "--force",
            f"--socket={munge_socket}",
            f"--key-file={key}",
            f"--pid-file={tmp}/munged.pid",
            f"--seed-file={tmp}/munged.seed",
        )
        deadline = time.monotonic() + 10  # slurmctld needs munge from its first message on
        while not munge_socket.exists() and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        daemon("slurmctld", bins["slurmctld"], "-D", "-f", str(conf))
        for name in nodes:
            daemon(f"slurmd-{name}", bins["slurmd"], "-D", "-f", str(conf), "-N", name)

        # Up when every node is idle; fail fast when a daemon exits.
        deadline, state = time.monotonic() + 60, ""
        while True:
            dead = [Path(p.args[0]).name for p in procs if p.poll() is not None]
            if dead:
                _give_up(f"{dead} exited during startup", tmp)
            state = subprocess.run(
                [bins["sinfo"], "-h", "-N", "-o", "%N %t"],
                env=daemon_env,
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            if sorted(state.split()[1::2]) == ["idle"] * len(nodes):
                break
            if time.monotonic() > deadline:
                _give_up(f"nodes not idle within 60 s: {state!r}", tmp)
            time.sleep(0.5)

        yield Slurm(env=env, hostname=host, nodes=nodes, tmp=tmp)
    finally:
        try:  # jobs first, so that slurmd/slurmstepd end their tasks the normal way
            if len(procs) > 1 and procs[1].poll() is None:
                subprocess.run(
                    [bins["scancel"], f"--user={getpass.getuser()}"],
                    env=daemon_env,
                    capture_output=True,
                    timeout=20,
                )
                deadline = time.monotonic() + 10
                while (
                    time.monotonic() < deadline
                    and subprocess.run(
                        [bins["squeue"], "-h"],
                        env=daemon_env,
                        capture_output=True,
                        text=True,
                        timeout=20,
                    ).stdout.strip()
                ):
                    time.sleep(0.5)
        finally:
            _stop(procs, tmp)
