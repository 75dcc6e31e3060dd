"""ddp_gather.py: every rank's objects and tensors, in rank order, both launch paths."""

import shutil

import pytest

from conftest import ROOT, last_line, metrics, python, run, torchrun


@pytest.mark.parametrize("launcher,world", [("spawn", 3), ("torchrun", 2)])
def test_all_gather_object_rank_order(tmp_path, launcher, world):
    out = tmp_path / "new" / "m.json"  # a folder that --metrics-out makes
    flags, script = ["--cpu", "--metrics-out", out], "ddp_gather.py"
    if launcher == "spawn":  # a user's copy: it reports its own name
        script = shutil.copy(ROOT / script, tmp_path / "my_gather.py")
    cmd = (
        python(script, "--nprocs", world, *flags)
        if launcher == "spawn"
        else torchrun(script, world, *flags)
    )
    res = run(cmd, timeout=120)
    m = metrics(out)
    assert m["world_size"] == world
    assert m["script"] == ("my_gather.py" if launcher == "spawn" else "ddp_gather.py")
    assert [g["dict"]["rank"] for g in m["gathered"]] == list(range(world))
    assert [g["list"] for g in m["gathered"]] == [[1 + r, 2 + r, 3 + r] for r in range(world)]
    assert [g["tensor"] for g in m["gathered"]] == [[1.0 + r] * 3 for r in range(world)]
    assert f"all_gather: {[[1.0 + r] * 3 for r in range(world)]}" in res.stdout
    assert res.stdout.splitlines()[-1] == f"done | gathered {world} objects | backend gloo"
    if launcher == "spawn":  # (torchrun itself warns that it set OMP_NUM_THREADS)
        assert res.stderr == ""  # nothing a user would have to read past


@pytest.mark.parametrize("nprocs", [0, -2, "two"])
def test_bad_nprocs_is_one_clear_line(nprocs):
    res = run(python("ddp_gather.py", "--cpu", "--nprocs", nprocs), timeout=60, check=False)
    assert res.returncode == 2
    assert last_line(res.stderr).startswith("ddp_gather.py: error: argument --nprocs: ")
