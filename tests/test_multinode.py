"""Two torchrun agents as two nodes on loopback (static rendezvous), and elastic restarts."""
import os
import signal
import socket
import sys
import time

import torch

from conftest import ROOT, finish, metrics, python, start

RESNET = ["--cpu", "--arch", "resnet18", "--image-size", 32, "--batch-size", 4, "--max-steps", 2,
          "--synthetic-size", 32, "--num-classes", 10, "--timeout", 60]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(rank: int, port: int, nproc: int, script: str, *flags) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
            f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
            str(ROOT / script), *map(str, flags)]


def two_nodes(nproc: int, script: str, flags0: list, flags1: list, check=True) -> list:
    port = free_port()
    procs = [start(node(0, port, nproc, script, *flags0)), start(node(1, port, nproc, script, *flags1))]
    return [finish(p, timeout=240, check=check) for p in procs]


def test_gather_across_two_nodes(tmp_path):
    out = tmp_path / "m.json"
    two_nodes(2, "ddp_gather.py", ["--cpu", "--metrics-out", out], ["--cpu"])
    m = metrics(out)
    assert m["world_size"] == 4 and m["same_on_every_rank"] is True
    assert [g["dict"]["rank"] for g in m["gathered"]] == [0, 1, 2, 3]


def test_resnet_across_two_nodes_with_a_shared_checkpoint_folder(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "m.json"
    flags = [*RESNET, "--epochs", 3, "--ckpt-dir", ckpt]
    two_nodes(1, "ddp_resnet.py", [*flags, "--metrics-out", out], flags)
    m = metrics(out)
    assert m["world_size"] == 2 and m["epochs_run"] == 3
    sha = m["param_sha256_per_rank"]
    assert len(sha) == 2 and sha[0] == sha[1]  # both nodes reloaded rank 0's epoch_2.pt
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch_1.pt", "epoch_2.pt", "epoch_3.pt"]


def test_only_global_rank_0_writes_checkpoints(tmp_path):
    """Node 1 has LOCAL_RANK 0 too; with a folder node 0 cannot see, it finds nothing to reload."""
    a, b = tmp_path / "node0", tmp_path / "node1"
    results = two_nodes(1, "ddp_resnet.py", [*RESNET, "--epochs", 2, "--ckpt-dir", a],
                        [*RESNET, "--epochs", 2, "--ckpt-dir", b], check=False)
    assert all(r.returncode != 0 for r in results)
    assert (a / "epoch_1.pt").is_file()
    assert not list(b.glob("epoch_*.pt"))  # node 1 wrote nothing
    assert f"error: cannot read checkpoint {b / 'epoch_1.pt'}" in results[1].stderr
