"""Minimal first: every script within its content budget (tests/budgets.txt: code tokens,
and run_all.sh's lines), laid out by `ruff format` at 88 and clean under `ruff check`, no
function over 40 code lines, each script self-contained, and the launch code the DDP scripts
repeat kept the same in all of them."""

import ast
import io
import re
import subprocess
import sys
import tokenize

import pytest

from conftest import ROOT

BUDGETS = {
    name: (int(limit), unit)
    for name, limit, unit in re.findall(
        r"^(\S+)\s+(\d+) (tokens|lines)$",
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
    sizes = {}
    for name, (_, unit) in BUDGETS.items():
        text = (ROOT / name).read_text()
        sizes[name] = code_tokens(text) if unit == "tokens" else len(text.splitlines())
    assert {n: s for n, s in sizes.items() if s > BUDGETS[n][0]} == {}, sizes


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
