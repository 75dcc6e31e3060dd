"""Minimal first: every file within its line budget (tests/budgets.txt), laid out by `ruff format`
and clean under `ruff check`, no function over 40 lines, each script self-contained, and the
launch code the DDP scripts repeat kept the same in all of them."""

import ast
import re
import subprocess
import sys

import pytest

from conftest import ROOT

BUDGETS = {
    name: int(limit)
    for name, limit in re.findall(
        r"^(\S+)\s+(\d+)$", (ROOT / "tests" / "budgets.txt").read_text(), re.M
    )
}
SCRIPTS = ["ddp_gather.py", "ddp_fashionmnist.py", "dp_resnet.py", "ddp_resnet.py"]
DDP = ["ddp_gather.py", "ddp_fashionmnist.py", "ddp_resnet.py"]


def ruff(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_every_file_has_a_budget_and_keeps_it():
    assert sorted(BUDGETS) == sorted([*SCRIPTS, "run_all.sh"])
    sizes = {name: len((ROOT / name).read_text().splitlines()) for name in BUDGETS}
    assert {n: s for n, s in sizes.items() if s > BUDGETS[n]} == {}, sizes


def test_ruff_decides_the_layout_and_finds_nothing():
    fmt = ruff("format", "--check", "--diff", *SCRIPTS, "tests")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    check = ruff("check", *SCRIPTS, "tests")
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_short_functions_and_no_imports_from_this_repo(script):
    tree = ast.parse((ROOT / script).read_text())
    long = {
        f.name: f.end_lineno - f.lineno + 1
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 40
    }
    assert long == {}
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {p.stem for p in ROOT.glob("*.py")}
    assert {m.split(".")[0] for m in imported} & ours == set()  # a user copies one file


def section(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


def test_the_repeated_launch_code_is_the_same_in_every_ddp_script():
    """Each file runs alone, so ddp_setup and the launch block are copies: a fix proven through
    one script (the free port, the thread split, the backend) holds in all three."""
    texts = {s: (ROOT / s).read_text() for s in DDP}
    for start, end in (
        ("def ddp_setup", "\n\n\n"),
        ("# --- launching", "def positive"),
        ("def positive", "\n\n\n"),
    ):
        copies = {s: section(t, start, end) for s, t in texts.items()}
        assert len(set(copies.values())) == 1, f"the copies of {start!r} differ"
