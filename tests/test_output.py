"""What a run prints while it runs: a start line before the first step, and never a long
silence. CPU, launched as a user would."""
import re

from conftest import finish, lines, python, start

SLOW = ["--cpu", "--arch", "resnet18", "--image-size", 320, "--batch-size", 32, "--max-steps", 9,
        "--log-every", 1000, "--epochs", 1]  # steps of several seconds, and no line by --log-every


def test_a_slow_run_is_never_quiet_for_long(tmp_path):
    proc = start(python("dp_resnet.py", *SLOW, "--ckpt-dir", tmp_path))
    seen = list(lines(proc, timeout=300))
    finish(proc, timeout=30)
    printed = [line for _, line in seen]
    assert printed[1].startswith("start | 1 process | CPU, no DataParallel | resnet18 320px | synthetic 12800 images")
    assert printed[2].startswith("note: resnet18 at 320px is slow on a CPU") and "--image-size 32" in printed[2]
    progress = [(t, line) for t, line in seen if re.match(r"epoch 1/1 \| step \d+/9 \|", line)]
    began = seen[1][0]  # the start line
    steps = [int(re.match(r"epoch 1/1 \| step (\d+)/9", line)[1]) for _, line in progress]
    assert steps[-1] == 9 and len(steps) >= 2, printed  # at least one line from the 30 s rule
    assert all(re.search(r"\| eta \S+$", line) for _, line in progress[:-1])
    times = [began] + [t for t, _ in progress]
    gaps = [b - a for a, b in zip(times, times[1:])]
    step_time = (progress[-1][0] - progress[0][0]) / (steps[-1] - steps[0])
    assert max(gaps) <= 30 + 2 * step_time, (gaps, step_time)
    assert any(line.startswith("note: at this speed an epoch takes about") for line in printed)
