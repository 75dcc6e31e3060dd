"""A user's own model and data: copy ddp_resnet.py (or dp_resnet.py), replace exactly
build_model and load_datasets (a small CNN with dropout, images randomly cropped and flipped in
the loader workers, a validation set), and the copy launches, trains, validates each image once,
saves and resumes as the original does: to the bit of a run that was never stopped."""

import difflib
import os
import shutil
import signal
import sys
import time

import pytest
import torch

from conftest import (
    ONE_THREAD,
    ROOT,
    finish,
    lines,
    metrics,
    python,
    recorded,
    run,
    same_weights,
    start,
    state,
    tagged,
)

OWN = '''def load_datasets(args):
    """Random crops and flips of the training images, plain validation images, two classes."""
    augment = T.Compose([T.RandomCrop(16, padding=2), T.RandomHorizontalFlip(), T.ToTensor()])
    train = datasets.FakeData(60, (3, 16, 16), 2, transform=augment)
    return train, datasets.FakeData(10, (3, 16, 16), 2, T.ToTensor(), random_offset=60), 2


def build_model(args, num_classes):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Dropout(0.5),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, num_classes),
    )
'''


def own_copy(folder, original="ddp_resnet.py", own=OWN):
    text = (ROOT / original).read_text()
    start, end = (
        text.index("def load_datasets"),
        text.index("\n\n\n", text.index("def build_model")),
    )
    copy = text[:start] + own.rstrip("\n") + text[end:]
    (folder / "my_training.py").write_text(copy)
    diff = [
        d
        for d in difflib.unified_diff(text.splitlines(), copy.splitlines(), lineterm="", n=0)
        if d[:1] in "+-" and not d.startswith(("+++", "---"))
    ]
    return folder / "my_training.py", diff


def test_own_model_and_data_in_two_functions(tmp_path):
    script, diff = own_copy(tmp_path)
    assert len(diff) <= 40  # one hunk: the two functions, nothing else
    print(
        f"the swap changes {len(diff)} lines: {sum(d[0] == '-' for d in diff)} out, {sum(d[0] == '+' for d in diff)} in"
    )
    ckpt, flags = tmp_path / "ckpt", ["--cpu", "--nprocs", 2, "--batch-size", 5, "--timeout", 60]
    flags += ["--workers", 1]  # the random crops and flips happen in a loader worker of each rank
    unbroken = tmp_path / "unbroken"  # 2 epochs, never stopped
    cmd = [sys.executable, script, *flags, "--epochs", 2, "--metrics-out", tmp_path / "m.json"]
    res = run([str(c) for c in [*cmd, "--ckpt-dir", unbroken]], timeout=180, env=ONE_THREAD)
    m = metrics(tmp_path / "m.json")
    assert (m["epochs_run"], m["steps"], m["val_samples"]) == (2, 6, 10)
    assert m["script"] == "my_training.py"  # the copy's own name, in the start line too
    assert res.stdout.splitlines()[0].startswith("start | my_training.py | world_size 2 |")
    assert "| model Sequential | data synthetic (60 images) |" in res.stdout.splitlines()[0]
    ckpt.mkdir()  # as if stopped after epoch 1
    shutil.copy(unbroken / "epoch_1.pt", ckpt)
    res = run([str(c) for c in [*cmd, "--ckpt-dir", ckpt, "--resume"]], timeout=120, env=ONE_THREAD)
    m = metrics(tmp_path / "m.json")
    assert (m["epochs_run"], m["val_samples"]) == (1, 10) and m["checkpoint"] == str(
        ckpt / "epoch_2.pt"
    )
    assert res.stdout.splitlines()[0].endswith(
        f"| epochs 2-2 | ckpt_dir {ckpt} | resuming from epoch_1.pt"
    )
    # every epoch's crops, flips and dropout come from --seed, the epoch and the rank: resumed
    # after epoch 1, the run ends where the one that never stopped ends
    same_weights(unbroken / "epoch_2.pt", ckpt / "epoch_2.pt")
    ckpt = torch.load(ckpt / "epoch_2.pt", weights_only=True)
    assert (
        ckpt["epoch"] == 2 and "0.weight" in ckpt["model_state_dict"]
    )  # a plain Sequential's keys


DP_OWN = OWN.replace(
    "return train, datasets.FakeData(10, (3, 16, 16), 2, T.ToTensor(), random_offset=60), 2",
    "return train, 2  # dp_resnet.py's load_datasets has no validation set",
)


def test_dataparallel_copy_resumes_to_the_bit_with_augmentation_and_dropout(tmp_path):
    """DataParallel has no sampler to set_epoch: each epoch draws a new order, seeded by the
    epoch, so a run resumed after epoch 1 draws in epoch 2 what an unbroken run drew, and ends
    with its weights. Through tests/recorded.py, which writes down each epoch's order."""
    script, _ = own_copy(tmp_path, "dp_resnet.py", DP_OWN)
    flags = ["--cpu", "--batch-size", 5, "--workers", 1, "--epochs", 2]
    first, unbroken = tmp_path / "first", tmp_path / "unbroken"
    unbroken_run = python("tests/recorded.py", tmp_path / "unbroken.rec", script, *flags)
    run([*unbroken_run, "--ckpt-dir", unbroken], timeout=180, env=ONE_THREAD)
    first.mkdir()  # as if stopped after epoch 1
    shutil.copy(unbroken / "epoch_1.pt", first)
    resumed_run = python("tests/recorded.py", tmp_path / "first.rec", script, *flags)
    run([*resumed_run, "--ckpt-dir", first, "--resume"], timeout=120, env=ONE_THREAD)
    same_weights(unbroken / "epoch_2.pt", first / "epoch_2.pt")
    whole, resumed = (recorded(tmp_path / f"{name}.rec", 1)[0] for name in ("unbroken", "first"))
    assert len(whole["draws"]) == 2 and whole["draws"][0] != whole["draws"][1]
    assert sorted(whole["draws"][0]) == sorted(whole["draws"][1]) == list(range(60))
    assert resumed["draws"] == whole["draws"][1:]
    assert whole["workers"][0] == 1


SLOW_TO_CLOSE = '''def load_datasets(args):
    """Two classes of random images, from loader workers that take 3 s to close (the files or
    the database of a user's own data): each epoch's end waits for them."""
    return SlowToClose(), None, 2


class SlowToClose(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if not hasattr(self, "closing"):  # once in each worker
            import multiprocessing.util

            self.closing = multiprocessing.util.Finalize(None, time.sleep, (3,), exitpriority=0)
        return torch.randn(3, 16, 16), i % 2
'''
# a linear model on the 3 x 16 x 16 images
LINEAR = """

def build_model(args, num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, num_classes))
"""
# dp_resnet.py's load_datasets returns no validation set
DP_SLOW_TO_CLOSE = SLOW_TO_CLOSE.replace("return SlowToClose(), None, 2", "return SlowToClose(), 2")


@pytest.mark.parametrize(
    "original, own, flags, last",
    [
        # every image, each epoch
        ("dp_resnet.py", DP_SLOW_TO_CLOSE, ["--batch-size", 4], "step 10/10"),
        # --max-steps: 5 of the 10 steps
        (
            "ddp_resnet.py",
            SLOW_TO_CLOSE,
            ["--nprocs", 2, "--batch-size", 2, "--max-steps", 5, "--timeout", 60],
            "step 5/5",
        ),
    ],
    ids=["dp_resnet.py", "ddp_resnet.py"],
)
def test_ctrl_c_while_an_epoch_ends_its_loader_workers_stops_the_run(
    original, own, flags, last, tmp_path
):
    """Ctrl-C to the whole group while the loader's workers close at an epoch's end: exit 130,
    quiet, and no later epoch. Before, an epoch left its loader at the last step, so the workers
    ended in the loader's __del__, where Python prints a KeyboardInterrupt and goes on: the run
    trained on, deaf to Ctrl-C and SIGTERM, and the DataParallel run exited 0."""
    script, _ = own_copy(tmp_path, original, own + LINEAR)
    cmd = [sys.executable, script, "--cpu", "--workers", 1, "--epochs", 2, *flags]
    proc = start([str(c) for c in [*cmd, "--ckpt-dir", tmp_path / "ckpt"]], env=ONE_THREAD)
    try:
        for _ in lines(proc, 120, until=lambda line: line.startswith(f"epoch 1/2 | {last}")):
            pass
        time.sleep(0.5)  # the workers close for 3 s from the last step on
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    finally:
        res = finish(proc, timeout=60, check=False)  # none outlives the test
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "epoch 2/2" not in res.stdout and "done |" not in res.stdout, res.stdout


SLOW_TO_LOAD = '''def load_datasets(args):
    """Two classes of random images, each ready after 50 ms. A Ctrl-C comes as the 11th batch
    is handed over, after step 10's line."""
    ctrl_c_at_a_handover(2 * 11)  # two file descriptors a batch: its images and its labels
    return SlowToLoad(), 2


def ctrl_c_at_a_handover(n):
    """A Ctrl-C to the whole group, as a terminal's, once this process has connected to the
    worker for the n-th file descriptor, and before it asks for it."""
    import itertools
    import multiprocessing.connection as connection

    client, connects = connection.Client, itertools.count(1)

    def cut(*args, **kwargs):
        conn = client(*args, **kwargs)
        if next(connects) == n:
            with conn:  # the Ctrl-C's exit closes the connection, as torch's `with` would
                os.killpg(0, signal.SIGINT)
        return conn

    connection.Client = cut


class SlowToLoad(torch.utils.data.Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.randn(3, 16, 16), i % 2
'''


def test_ctrl_c_while_a_worker_hands_a_batch_over_is_quiet(tmp_path):
    """Ctrl-C to the whole group while the training process waits for its worker to hand a
    batch over: exit 130, no traceback. Each batch comes as file descriptors, sent by a thread
    of the worker (multiprocessing's resource_sharer) over a connection the training process
    opens; a Ctrl-C closes it, and that thread printed EOFError or BrokenPipeError. (Named
    shared memory, the file_system strategy, avoided the connection, but its torch_shm_manager
    aborted with 'terminate called ... Broken pipe' when a worker died as it started:
    test_faults.py, -k workers_start.)"""
    script, _ = own_copy(tmp_path, "dp_resnet.py", SLOW_TO_LOAD + LINEAR)
    cmd = [sys.executable, script, "--cpu", "--workers", 1, "--batch-size", 2, "--epochs", 1]
    cmd += ["--ckpt-dir", tmp_path / "ckpt"]
    res = run([str(c) for c in cmd], timeout=120, check=False, env=ONE_THREAD)
    assert "epoch 1/1 | step 10/200" in res.stdout  # the progress line before the handover
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "done |" not in res.stdout


STOPS_AFTER_ITS_LAST_BATCH = '''def load_datasets(args):
    """Two classes of random images. The loader worker stops (SIGSTOP) 2 s after it loads the
    epoch's last image, its work done (the training process takes the last batches well within
    that), as a debugger or a job manager may stop it."""
    return StopsAfterItsLastBatch(), 2


class StopsAfterItsLastBatch(torch.utils.data.Dataset):
    def __init__(self):
        self.loaded = 0  # counted in the worker's copy

    def __len__(self):
        return 20

    def __getitem__(self, i):
        self.loaded += 1
        if self.loaded == len(self):
            threading.Timer(2, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        return torch.randn(3, 16, 16), i % 2
'''


@pytest.mark.parametrize("original", ["dp_resnet.py", "ddp_resnet.py"])
def test_a_stopped_loader_worker_does_not_hold_the_exit(original, tmp_path):
    """A loader worker stopped (SIGSTOP) after the epoch's last batch: the run ends, exit 0,
    and leaves no process. Python's exit waits for each worker, and waited forever for it (a
    spawned rank's exit too, which multiprocessing runs)."""
    own = STOPS_AFTER_ITS_LAST_BATCH + LINEAR
    if original == "ddp_resnet.py":  # one spawned rank, which loads every image
        own = own.replace("StopsAfterItsLastBatch(), 2", "StopsAfterItsLastBatch(), None, 2")
    script, _ = own_copy(tmp_path, original, own)
    cmd = [sys.executable, script, "--cpu", "--workers", 1, "--batch-size", 2, "--epochs", 1]
    cmd += ["--nprocs", 1] if original == "ddp_resnet.py" else []
    cmd += ["--ckpt-dir", tmp_path / "ckpt"]
    res = run([str(c) for c in cmd], timeout=90, env=ONE_THREAD)
    assert "done | epochs_run 1" in res.stdout


SLOW_RANK = OWN.replace(
    "def build_model(args, num_classes):\n",
    "def build_model(args, num_classes):\n"
    "    if dist.get_rank() == 1:  # a slow rank: held stopped until the test lets it go\n"
    "        os.kill(os.getpid(), signal.SIGSTOP)\n",
)


def test_ctrl_c_while_a_rank_waits_for_a_slower_one_is_quiet(tmp_path):
    """Ctrl-C to the whole group while rank 0 waits in DDP's first broadcast for rank 1, a slow
    rank (held stopped here): exit 130, no traceback. Before, rank 1 ended at once, rank 0's
    broadcast failed ("Connection closed by peer"), and its Ctrl-C came as a KeyboardInterrupt
    while torch's spawn wrapper handled that error: both printed, chained."""
    script, _ = own_copy(tmp_path, own=SLOW_RANK)
    cmd = [sys.executable, script, "--cpu", "--batch-size", 4, "--ckpt-dir", tmp_path / "ckpt"]
    proc = start([str(c) for c in cmd])
    try:
        deadline = time.monotonic() + 120
        while not (stopped := [pid for pid in tagged(proc.mark) if state(pid) == "T"]):
            assert time.monotonic() < deadline and proc.poll() is None, "rank 1 never stopped"
            time.sleep(0.05)
        time.sleep(2)  # rank 0 builds its model, then waits for rank 1 in the broadcast
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
        time.sleep(0.5)
        os.kill(stopped[0], signal.SIGCONT)
    finally:
        res = finish(proc, timeout=60, check=False)  # none outlives the test
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr[-3000:]
