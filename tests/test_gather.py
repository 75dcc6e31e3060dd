"""ddp_gather.py: every rank's object comes back, in rank order, on every rank."""
import pytest

from conftest import metrics, python, run, torchrun


def expected(rank: int) -> dict:
    return {"tensor": [1.0 + rank] * 3, "list": [1 + rank, 2 + rank, 3 + rank], "dict": {"rank": rank}}


@pytest.mark.parametrize("launcher,world", [("spawn", 3), ("torchrun", 2)])
def test_all_gather_object_rank_order(tmp_path, launcher, world):
    """Spawned, also under TORCH_DISTRIBUTED_DEBUG=DETAIL (its collective checks on)."""
    out = tmp_path / "m.json"
    if launcher == "spawn":
        cmd = python("ddp_gather.py", "--cpu", "--nprocs", world, "--metrics-out", out)
    else:
        cmd = torchrun("ddp_gather.py", world, "--cpu", "--metrics-out", out)
    res = run(cmd, timeout=120, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if launcher == "spawn" else None)
    m = metrics(out)
    assert m["world_size"] == world and m["backend"] == "gloo"
    assert m["gathered"] == [expected(r) for r in range(world)]
    assert m["gathered_tensors"] == [[1.0 + r] * 3 for r in range(world)]
    assert f"gathered {world} objects" in res.stdout
    assert res.stdout.splitlines()[0] == f"start | {world} processes | gloo on CPU | one dict and one tensor per rank"


def test_nprocs_zero_is_one_clear_error():
    res = run(python("ddp_gather.py", "--nprocs", "0"), timeout=60, check=False)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == ["error: --nprocs must be positive, got 0"]
