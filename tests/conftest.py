"""Shared test helpers: launch the scripts the way a user does, with a hard timeout, and
make sure no process of a run outlives it."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
MARK = "DDP_COLLECTION_TEST_RUN"  # every process of a run inherits it: how leftovers are found
# Hermetic on a GPU machine too: the tests are written for CPU runs (a test that wants a GPU
# would pass its own CUDA_VISIBLE_DEVICES), and every run inherits this.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# On pytest-xdist's workers every core is busy. An OpenMP thread whose peer waits for a core
# then spins (a 2-thread dp_resnet.py run took 26 CPU-s instead of 6); passive threads sleep.
# The same threads compute the same results: only the waiting changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Started in the background (`cmd &` in a script), pytest ignores Ctrl-C, and so would every run
# it starts: exec keeps an ignored signal. The tests send Ctrl-C as a terminal does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    # .ci/run runs these a second time on the oldest kernels (no AVX): their bars must hold on
    # any x86 CPU, not only on the one where the test was written
    config.addinivalue_line("markers", "learned: asserts what training learned (an accuracy)")


# The longest tests first, the longest of all first (they start the most Python processes): on
# pytest-xdist's 2 workers, a long test started last would run alone while the other worker had
# nothing left to do.
FIRST = [
    "test_run_all_passes_where_nvidia_smi_lists_a_gpu_torch_cannot_see",
    "test_bench_on_cpu_prints_a_table_of_measured_figures",
    "test_own_model_and_data_in_two_functions",
    "test_each_image_scored_once_at_any_world_size",
    "test_full_disk_during_a_save",
    "test_a_stop_mid_epoch_then_ctrl_c_during_a_save_then_resume",
    "test_ddp_on_two_ranks_equals_one_process_on_their_global_batch",
    "test_bad_input_fails_before_training_and_names_the_cause",
    "test_elastic_restart_resumes_and_matches_an_uninterrupted_run",
    "test_two_calls_at_once_in_one_runs_dir_keep_their_own_rows_and_the_users_files",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    # a stable sort: the others as they were found
    items.sort(key=lambda item: rank.get(item.originalname, len(FIRST)))


def start(args: list, cwd=None, env=None, preexec_fn=None) -> subprocess.Popen:
    """Start a command in its own process group, tagged so its descendants can be found."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), MARK: uuid.uuid4().hex}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or var not in env:
            full_env.pop(var, None)  # a test never inherits a launcher's rendezvous by accident
    proc = subprocess.Popen(
        args,
        cwd=cwd or ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    proc.mark = full_env[MARK]
    return proc


def tagged(mark: str) -> list:
    """Live processes carrying this run's tag (zombies have no environment, so they don't count)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"{MARK}={mark}".encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def started_loader_workers(mark: str) -> list:
    """The run's loader workers (the processes a forkserver started) once their start has
    run worker_init: SIGINT is among the signals they ignore, and its thread runs. (A child just
    forked ignores SIGINT too, with one thread, until it restores its handlers: a SIGINT then
    found it with the default action, and killed it, 1 suite run of many.)"""
    servers, workers = set(), []
    for pid in tagged(mark):
        try:
            if "forkserver" in open(f"/proc/{pid}/cmdline").read():
                servers.add(pid)
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
            ignores_sigint = int(status["SigIgn"], 16) & 1 << (signal.SIGINT - 1)
            if ignores_sigint and int(status["Threads"]) > 1:
                workers.append((pid, int(status["PPid"])))
        except OSError:  # it just ended
            pass
    return [pid for pid, parent in workers if parent in servers]


def cmdline(pid: int) -> str:
    """A process's command line; "" once it has ended (a short-lived child, say)."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def state(pid: int) -> str:
    """A process's state letter, as /proc shows it (T: stopped); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def described(proc: subprocess.Popen) -> list:
    """The run's live processes, each as its pid, state letter and command line."""
    found = []
    for pid in sorted({proc.pid, *tagged(proc.mark)}):
        command = cmdline(pid).replace("\0", " ")
        if state(pid):  # "" once it has ended
            found.append(f"{pid} {state(pid)} {command[:120]}")
    return found


def kill_all(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *tagged(proc.mark)]:
        try:
            os.killpg(pid, signal.SIGKILL) if pid == proc.pid else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def finish(
    proc: subprocess.Popen, timeout: float, check: bool = True, linger: float = 10
) -> subprocess.CompletedProcess:
    """Wait for a started command; fail on timeout, on a non-zero exit (with check) and when
    any of its processes is still alive `linger` seconds after it exited."""
    args = proc.args
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        alive = described(proc)  # which processes held the run open, before they are killed
        kill_all(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"timed out after {timeout}s: {' '.join(map(str, args))}\n{out[-3000:]}\n{err[-3000:]}"
            f"\nstill running then: {alive}"
        )
    deadline = time.monotonic() + linger
    while tagged(proc.mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = tagged(proc.mark)
    kill_all(proc)
    if left:
        pytest.fail(
            f"{len(left)} process(es) outlived {' '.join(map(str, args))}: {left}\n{err[-3000:]}"
        )
    result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check and proc.returncode != 0:
        pytest.fail(
            f"exit {proc.returncode}: {' '.join(map(str, args))}\n{out[-3000:]}\n{err[-3000:]}"
        )
    return result


def finish_all(procs: list, timeout: float, check: bool = True) -> list:
    """finish() each of several commands (two nodes, say); when one fails, the others are
    killed before the test fails, so none of them outlives it."""
    done = []
    try:
        for proc in procs:
            done.append(finish(proc, timeout, check))
    except BaseException:
        for proc in procs[len(done) :]:
            kill_all(proc)
        raise
    return done


def run(args: list, timeout: float, cwd=None, env=None, check=True, preexec_fn=None):
    return finish(start(args, cwd, env, preexec_fn), timeout, check)


def lines(proc: subprocess.Popen, timeout: float, until=lambda line: False):
    """Yield (time, line) from a started command's stdout as each line comes (read unbuffered,
    so the time is the line's), until one satisfies `until`, the output ends, or `timeout`
    seconds have passed (then the test fails)."""
    deadline, fd, pending = time.monotonic() + timeout, proc.stdout.fileno(), b""
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield time.monotonic(), line.decode()
            if until(line.decode()):
                return
        left = deadline - time.monotonic()
        if left <= 0:
            kill_all(proc)
            pytest.fail(f"no end of output within {timeout}s: {' '.join(map(str, proc.args))}")
        if select.select([fd], [], [], min(left, 1))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            pending += chunk


def occupy(port: int):
    """A socket listening on 127.0.0.1:port, as another program's; None if it is taken already."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        s.listen()
        return s
    except OSError:  # taken already: just as good for a test that wants it busy
        s.close()
        return None


def free_port() -> int:
    """A port that was free a moment ago (the system's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python(script: str, *flags) -> list:
    return [sys.executable, str(ROOT / script), *map(str, flags)]


def torchrun(script: str, nproc: int, *flags) -> list:
    # `python -m torch.distributed.run` is the torchrun console script, from this interpreter.
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(ROOT / script),
        *map(str, flags),
    ]


def fm_report(res, m: dict, script: str, epochs: int, batch: int = 100) -> None:
    """A 2-rank synthetic ddp_fashionmnist.py run's metrics and lines: what ran where, each test
    image scored once, the last epoch's loss as its final_loss, and the done line."""
    assert (m["world_size"], m["backend"], m["device"], m["data"]) == (
        2,
        "gloo",
        "cpu",
        "synthetic",
    )
    assert m["test_samples"] == 10000 and m["test_accuracy"] == m["test_correct"] / 10000
    lines = res.stdout.splitlines()
    assert lines[0] == (
        f"start | {script} | world_size 2 | backend gloo | device cpu | data synthetic "
        f"(60000 images) | batch {batch} x 2 | epochs {epochs}"
    ), lines[0]
    last = lines[epochs]
    assert last.startswith(f"epoch {epochs}/{epochs} | loss {m['final_loss']:.4f} | "), lines
    assert last.endswith(" img/s")
    assert lines[epochs + 1] == f"done | test_accuracy {m['test_accuracy']:.4f} (10000 images)"


def metrics(path) -> dict:
    return json.loads(Path(path).read_text())


def recorded(out, ranks: int) -> list:
    """What each process of a run through tests/recorded.py OUT wrote down, by rank."""
    return [metrics(out.with_name(f"{out.name}.{r}.json")) for r in range(ranks)]


TINY = ["--cpu", "--arch", "resnet18", "--image-size", 32]  # a ResNet that trains in seconds
# resnet18 on 32 px synthetic images, 2 steps an epoch: the small DDP run most tests share
RESNET = [*TINY, "--batch-size", 4, "--max-steps", 2, "--timeout", 60]
DP = RESNET[1:-2]  # dp_resnet.py: one process, no --timeout
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the same kernels in every run: bitwise-comparable weights


@pytest.fixture(scope="session", autouse=True)
def own_tmpdir(tmp_path_factory):
    """Every run's temporary files in pytest's own folder, which pytest prunes. torch leaves
    some behind: torchrun a folder each run, mp.spawn an error file where a rank fails."""
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """One 3-epoch spawned DDP run: what other launches, resumes and nodes must reproduce. Under
    pytest-xdist (-n), the first worker to ask runs it and the others read its folder."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this session's folder, above each worker's own
    folder = shared / "uninterrupted"
    with FileLock(shared / "uninterrupted.lock"):  # filelock: a requirement of torch
        if not (shared / "uninterrupted.err").exists():
            folder.mkdir(exist_ok=True)  # a failed first try fails again, clearly
            result = run(
                python(
                    "ddp_resnet.py",
                    *RESNET,
                    "--nprocs",
                    2,
                    "--epochs",
                    3,
                    "--ckpt-dir",
                    folder,
                    "--metrics-out",
                    folder / "metrics.json",
                ),
                timeout=180,
                env=ONE_THREAD,
            )
            (shared / "uninterrupted.out").write_text(result.stdout)
            (shared / "uninterrupted.err").write_text(result.stderr)  # written last: done
    return folder, *((shared / f"uninterrupted.{s}").read_text() for s in ("out", "err"))


@pytest.fixture
def read_only(tmp_path):
    """A folder nothing can be written in, and the words of the error a write there gets: a
    read-only tmpfs where the tests run as root (as CI does), else a folder of mode 0o555."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder, "[Errno 13] Permission denied"
        folder.chmod(0o755)
        return
    tmpfs(folder, "ro,size=1m")
    yield folder, "[Errno 30] Read-only file system"
    subprocess.run(["umount", "-l", folder])


def unavailable(why: str, details: str = "") -> None:
    """What a test needs is missing here (a Debian package, root). CI has it all (.ci/run runs
    as root and installs the packages), so there the test fails, never skipped unseen;
    elsewhere it is skipped, saying why."""
    if os.environ.get("CI"):
        pytest.fail(f"CI must have this: {why}\n{details}".rstrip())
    pytest.skip(why)


def debian_fmnist() -> Path:
    """The folder of Debian's four FashionMNIST .gz files (dataset-fashion-mnist)."""
    if not (DEBIAN_FMNIST / "t10k-labels-idx1-ubyte.gz").is_file():
        unavailable("Debian's dataset-fashion-mnist is not installed")
    return DEBIAN_FMNIST


def tmpfs(folder, options: str) -> None:
    """Mount a tmpfs on the folder: root can, as CI runs."""
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", folder], capture_output=True, text=True
    )
    if mount.returncode:
        unavailable(f"cannot mount a tmpfs here ({mount.stderr.strip()}); needs root")


def same_weights(a, b) -> None:
    """Two checkpoints hold bitwise-equal weights and momentum buffers."""
    import torch

    a, b = (torch.load(f, map_location="cpu", weights_only=True) for f in (a, b))
    assert a["model_state_dict"].keys() == b["model_state_dict"].keys()
    for k, t in a["model_state_dict"].items():
        assert torch.equal(t, b["model_state_dict"][k]), f"{k} differs"
    for i, s in a["optimizer_state_dict"]["state"].items():
        assert torch.equal(
            s["momentum_buffer"], b["optimizer_state_dict"]["state"][i]["momentum_buffer"]
        )


def last_line(stderr: str) -> str:
    """The one line a refused run prints (argparse puts its usage before it)."""
    lines = stderr.strip().splitlines()
    assert lines and "Traceback" not in stderr, stderr
    return lines[-1]
