"""Two torchrun agents as two nodes on loopback (static rendezvous), and elastic restarts."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import (
    ONE_THREAD,
    RESNET,
    ROOT,
    finish,
    finish_all,
    free_port,
    metrics,
    same_weights,
    start,
    unavailable,
)


def node(rank: int, port: int, nproc: int, script: str, *flags) -> list:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={rank}",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(ROOT / script),
        *map(str, flags),
    ]


def two_nodes(nproc: int, script: str, flags0: list, flags1: list, check=True) -> list:
    port = free_port()
    procs = [
        start(node(rank, port, nproc, script, *flags), env=ONE_THREAD)
        for rank, flags in enumerate((flags0, flags1))
    ]
    return finish_all(procs, timeout=240, check=check)


def test_gather_across_two_nodes(tmp_path):
    out = tmp_path / "m.json"
    two_nodes(2, "ddp_gather.py", ["--cpu", "--metrics-out", out], ["--cpu"])
    m = metrics(out)
    assert m["world_size"] == 4
    assert [g["dict"]["rank"] for g in m["gathered"]] == [0, 1, 2, 3]


def test_processes_with_rank_but_no_local_rank_join_as_that_rank(uninterrupted, tmp_path):
    """A Kubernetes PyTorchJob starts one process per pod with MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE and RANK, and no LOCAL_RANK: each joins the group as that rank, local rank 0.
    Here by hand, both at once; the ResNet trains the weights of a spawned run, and
    FashionMNIST on 3 ranks scores each of its 10,000 test images once: shares of 3334, 3333 and
    3333 (a DistributedSampler would score 10,002)."""
    ckpt, out = tmp_path / "ckpt", {s: tmp_path / f"{s}.json" for s in ("fm", "resnet")}
    runs = {
        "fm": ["ddp_fashionmnist.py", "--cpu", "--synthetic", "--epochs", 1, "--timeout", 60],
        "resnet": ["ddp_resnet.py", *RESNET, "--epochs", 2, "--ckpt-dir", ckpt],
    }
    procs = []
    for name, (script, *flags) in runs.items():
        world = 3 if name == "fm" else 2
        env = {
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        for rank in range(world):
            metrics_flags = ["--metrics-out", out[name]] if rank == 0 else []
            cmd = [sys.executable, str(ROOT / script), *map(str, [*flags, *metrics_flags])]
            procs.append(start(cmd, env={**env, "RANK": str(rank), **ONE_THREAD}))
    finish_all(procs, timeout=240)
    assert metrics(out["fm"])["world_size"] == 3 and metrics(out["fm"])["test_samples"] == 10000
    assert metrics(out["resnet"])["world_size"] == 2
    same_weights(uninterrupted[0] / "epoch_2.pt", ckpt / "epoch_2.pt")


def test_only_global_rank_0_writes_checkpoints(tmp_path):
    """Node 1 has LOCAL_RANK 0 too; with a folder node 0 cannot see, it finds nothing to reload."""
    a, b = tmp_path / "node0", tmp_path / "node1"
    results = two_nodes(
        1,
        "ddp_resnet.py",
        [*RESNET, "--epochs", 2, "--ckpt-dir", a],
        [*RESNET, "--epochs", 2, "--ckpt-dir", b],
        check=False,
    )
    assert all(r.returncode != 0 for r in results)
    assert (a / "epoch_1.pt").is_file()
    assert not list(b.glob("epoch_*"))  # node 1 wrote nothing
    assert f"No such file or directory: '{b / 'epoch_1.pt'}'" in results[1].stderr


def test_rank_0_decides_where_every_rank_resumes(uninterrupted, tmp_path):
    """Node 1 sees a stale epoch_7.pt that node 0 does not (its folder links node 0's files, plus
    one extra). Had each rank picked its start from its own listing, node 1 would skip to epoch 8
    and node 0 would wait for it; rank 0's choice, epoch 2, holds for both."""
    a, b = tmp_path / "node0", tmp_path / "node1"
    a.mkdir(), b.mkdir()
    (a / "epoch_1.pt").write_bytes((uninterrupted[0] / "epoch_1.pt").read_bytes())
    for epoch in (1, 2, 3):
        (b / f"epoch_{epoch}.pt").symlink_to(
            a / f"epoch_{epoch}.pt"
        )  # 2 and 3: once rank 0 saves them
    (b / "epoch_7.pt").write_bytes((uninterrupted[0] / "epoch_1.pt").read_bytes())
    flags = [*RESNET, "--epochs", 3, "--resume"]
    results = two_nodes(1, "ddp_resnet.py", [*flags, "--ckpt-dir", a], [*flags, "--ckpt-dir", b])
    assert (
        results[0]
        .stdout.splitlines()[0]
        .endswith(f"| epochs 2-3 | ckpt_dir {a} | resuming from epoch_1.pt")
    )
    same_weights(uninterrupted[0] / "epoch_3.pt", a / "epoch_3.pt")


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: hosts 10.213.0.1 and 10.213.0.2 that
    exist only inside this test. Needs root (CAP_NET_ADMIN), as CI has."""
    tag = f"{os.getpid() % 100000}"
    names = [f"ddp{tag}a", f"ddp{tag}b"]
    setup = [
        ["ip", "netns", "add", names[0]],
        ["ip", "netns", "add", names[1]],
        ["ip", "link", "add", f"v{names[0]}", "type", "veth", "peer", "name", f"v{names[1]}"],
    ]
    for i, name in enumerate(names):
        setup += [
            ["ip", "link", "set", f"v{name}", "netns", name],
            ["ip", "-n", name, "addr", "add", f"10.213.0.{i + 1}/24", "dev", f"v{name}"],
            ["ip", "-n", name, "link", "set", f"v{name}", "up"],
            ["ip", "-n", name, "link", "set", "lo", "up"],
        ]
    # A machine without iproute2 (a container image, say) has no `ip` to run at all.
    if shutil.which("ip") is None:
        unavailable("cannot create network namespaces: no `ip` command (Debian's iproute2)")
    try:
        for cmd in setup:
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                unavailable(f"cannot create network namespaces: {' '.join(cmd)} failed; needs root")
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_network_namespaces_as_two_hosts(two_hosts, uninterrupted, tmp_path):
    """Each node reaches the other only through its own address; gloo must be told which
    interface to use (GLOO_SOCKET_IFNAME), or it binds to the loopback its hostname resolves to.
    The nodes share a checkpoint folder: rank 0's checkpoints, reloaded by both nodes, are
    those of one machine's run. (On loopback, without root: the two resumes below.)"""
    port, out, ckpt = free_port(), tmp_path / "m.json", tmp_path / "ckpt"
    procs = []
    for rank, ns in enumerate(two_hosts):
        cmd = node(
            rank,
            port,
            1,
            "ddp_resnet.py",
            *RESNET,
            "--epochs",
            2,
            "--ckpt-dir",
            ckpt,
            *(["--metrics-out", out] if rank == 0 else []),
        )
        cmd[cmd.index("--master-addr=127.0.0.1")] = "--master-addr=10.213.0.1"
        procs.append(
            start(
                ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME=v{ns}", *cmd],
                env=ONE_THREAD,
            )
        )
    finish_all(procs, timeout=240)
    m = metrics(out)
    assert m["world_size"] == 2 and m["epochs_run"] == 2
    assert sorted(p.name for p in ckpt.glob("epoch_*.pt")) == ["epoch_1.pt", "epoch_2.pt"]
    # both nodes reloaded rank 0's checkpoints and trained on: the weights of one machine's run
    same_weights(uninterrupted[0] / "epoch_2.pt", ckpt / "epoch_2.pt")


def test_elastic_restart_resumes_and_matches_an_uninterrupted_run(uninterrupted, tmp_path):
    """torchrun --max-restarts=1 with rank 0 SIGKILLed after epoch 1: the new workers resume
    from the newest checkpoint and end with the weights of a run that was never interrupted (the
    weights of spawn, under torchrun)."""
    ckpt = tmp_path / "elastic"
    agent = start(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            str(ROOT / "ddp_resnet.py"),
            *map(str, RESNET),
            "--epochs",
            "3",
            "--resume",
            "--ckpt-dir",
            str(ckpt),
        ],
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **ONE_THREAD},
    )  # see README: gloo needs it
    deadline = time.monotonic() + 180
    while (
        not (ckpt / "epoch_1.pt").exists() and time.monotonic() < deadline and agent.poll() is None
    ):
        time.sleep(0.05)
    with open(f"/proc/{agent.pid}/task/{agent.pid}/children") as f:
        workers = [int(c) for c in f.read().split()]
    assert len(workers) == 2, workers
    rank0 = next(
        w for w in workers if b"\0RANK=0\0" in b"\0" + open(f"/proc/{w}/environ", "rb").read()
    )
    os.kill(rank0, signal.SIGKILL)
    res = finish(agent, timeout=300)
    starts = [line for line in res.stdout.splitlines() if line.startswith("start |")]
    assert starts[0].endswith(f"| epochs 1-3 | ckpt_dir {ckpt} | no checkpoint to resume from")
    assert re.search(r"\| epochs [23]-3 \|", starts[1]), starts
    same_weights(uninterrupted[0] / "epoch_3.pt", ckpt / "epoch_3.pt")
