"""Minimal first: every script within its budgets (tests/budgets.txt: code tokens and lines),
laid out by `ruff format` at 88 and clean under `ruff check`, lines that read at a glance (mean
length, few trailing comments), no function over 40 code lines, each script self-contained,
and the helpers and launching section the DDP scripts repeat the same in all of them."""

import ast
import io
import re
import subprocess
import sys
import tokenize

import pytest

from conftest import ROOT

BUDGETS = {
    name: (int(tokens or 0), int(lines))
    for name, tokens, lines in re.findall(
        r"^(\S+)\s+(?:(\d+) tokens)?\s+(\d+) lines\b",
        (ROOT / "tests" / "budgets.txt").read_text(),
        re.M,
    )
}
SCRIPTS = ["ddp_gather.py", "ddp_fashionmnist.py", "dp_resnet.py", "ddp_resnet.py"]
DDP = ["ddp_gather.py", "ddp_fashionmnist.py", "ddp_resnet.py"]
LAYOUT = {
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def code_tokens(text: str) -> int:
    """Tokens without comments, docstrings and layout, as density.py counts them on Python
    3.11: there an f-string is one token, and so it is here on every Python (3.12 and later
    split it into parts)."""
    count, prev, depth = 0, None, 0
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        name = tokenize.tok_name[t.type]
        if name == "FSTRING_START":
            depth += 1
            count += depth == 1
        elif name == "FSTRING_END":
            depth -= 1
        elif depth == 0 and t.type not in LAYOUT | {tokenize.COMMENT}:
            starts = prev in (None, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            count += not (t.type == tokenize.STRING and starts)  # a docstring is not code
        if t.type not in (tokenize.NL, tokenize.COMMENT):
            prev = t.type
    return count


def test_code_tokens_count_content_not_layout():
    one = 'def f(a):\n    """Doc."""\n    x = f"{a} b"  # why\n    return x\n'
    other = 'def f(a):\n\n    # why\n    x = (\n        f"{a} b"\n    )\n    return x\n'
    assert code_tokens(one) == code_tokens(other) - 2 == 11  # the parentheses count


def test_every_file_has_a_budget_and_keeps_it():
    assert sorted(BUDGETS) == sorted([*SCRIPTS, "run_all.sh"])
    over = {}
    for name, (tokens, lines) in BUDGETS.items():
        text = (ROOT / name).read_text()
        size = (code_tokens(text) if name.endswith(".py") else 0, len(text.splitlines()))
        if size[0] > tokens or size[1] > lines:
            over[name] = size
    assert over == {}, f"(tokens, lines) over budget: {over}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_lines_read_at_a_glance(script):
    """The scripts people copy average 41-47 characters a line, with trailing comments on few
    lines (../shared/STYLE.md): here a mean of at most 55 characters a non-blank line, trailing
    comments on at most 12% of code lines, no line over 88."""
    text = (ROOT / script).read_text()
    lines = text.splitlines()
    nonblank = [line for line in lines if line.strip()]
    assert sum(map(len, nonblank)) / len(nonblank) <= 55
    assert max(map(len, lines)) <= 88
    code, trailing = set(), 0
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.COMMENT and lines[t.start[0] - 1][: t.start[1]].strip():
            trailing += 1
        elif t.type not in LAYOUT | {tokenize.COMMENT}:
            code.update(range(t.start[0], t.end[0] + 1))
    assert trailing <= 0.12 * len(code), trailing


def ruff(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ruff_decides_the_layout_and_finds_nothing():
    fmt = ruff("format", "--check", "--diff", *SCRIPTS, "tests")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    check = ruff("check", *SCRIPTS, "tests")
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_short_functions_and_no_imports_from_this_repo(script):
    tree = ast.parse((ROOT / script).read_text())
    lines = (ROOT / script).read_text().splitlines()
    code_lines = {  # comment-only and blank lines are not counted
        f.name: sum(
            line.strip()[:1] not in ("", "#") for line in lines[f.lineno - 1 : f.end_lineno]
        )
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
    }
    assert {name: n for name, n in code_lines.items() if n > 40} == {}
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {p.stem for p in ROOT.glob("*.py")}
    assert {m.split(".")[0] for m in imported} & ours == set()  # a user copies one file


def section(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


def test_the_repeated_helpers_and_launching_are_the_same_in_every_script():
    """Each file runs alone, so ddp_setup, print0, exit_quietly, ignore_stops, positive, the loader
    workers' helpers and the launching section are copies: a fix proven through one script (the
    free port, the thread split, the backend) holds in all of them."""
    texts = {s: (ROOT / s).read_text() for s in SCRIPTS}
    for start, end, scripts in (
        ("def ddp_setup", "\n\n\n", DDP),
        ("def print0", "\n\n\n", ["ddp_fashionmnist.py", "ddp_resnet.py"]),
        ("# --- launching", "# --- end of launching ---", DDP),
        ("def positive", "\n\n\n", SCRIPTS),
        ("def exit_quietly", "\n\n\n", SCRIPTS),
        ("def ignore_stops", "\n\n\n", SCRIPTS),
        ("# Ctrl-C while torch imports", "import torch\n", DDP),
        ("def start_forkserver", "\n\n\n", ["dp_resnet.py", "ddp_resnet.py"]),
        ("class WorkerLoader", "\n\n\n", ["dp_resnet.py", "ddp_resnet.py"]),
        ("def worker_init", "\n\n\n", ["dp_resnet.py", "ddp_resnet.py"]),
        ("def exit_after_parent", "\n\n\n", ["dp_resnet.py", "ddp_resnet.py"]),
    ):
        copies = {s: section(texts[s], start, end) for s in scripts}
        assert len(set(copies.values())) == 1, f"the copies of {start!r} differ"


def test_each_revert_of_the_sweep_still_finds_its_line():
    """tests/revert_sweep.py puts tutorial lines back in place of ours: each of ours is there."""
    from revert_sweep import R

    for name, script, replacements, _ in R:
        text = (ROOT / script).read_text()
        assert all(old in text for old, _ in replacements), name
