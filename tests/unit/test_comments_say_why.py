"""Comments say why, not history (house rules): no comment or docstring of the shipped
packages tells where code used to live, what it was once called or what it replaced.

Where a thing lives is what the code and ``git log`` say; a comment about its past goes
stale at the next move and tells a reader nothing about why the code is as it is. A
protocol's or a file format's versions are not history in this sense (they say why a
reader accepts old input), so the phrases below are only those that speak of code.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "clients", "log", "snapshot")

_WORDS = (
    r"moved (out of|from|here|over from)",
    r"formerly",
    r"(was|were) renamed",
    r"now lives? (in|at|here)",
    r"used to (live|be called|be named|sit)",
    r"(was|were) once called",
    r"once lived",
    r"its old (home|name)",
    r"the old (name|meaning|home)",
    r"(were|was) always logged under",
)
#: One pattern; words may be split over lines (a docstring's or a comment block's).
HISTORY = re.compile(
    "|".join(r"\b" + words.replace(" ", r"\s+") + r"\b" for words in _WORDS), re.IGNORECASE
)


def _comment_blocks(source: str) -> list[tuple[int, str]]:
    """Each run of comments on consecutive lines: (first line, text without the ``#``)."""
    blocks: list[tuple[int, list[str]]] = []
    last_line = -2
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        text = token.string.lstrip("#").strip()
        if line == last_line + 1 and blocks:
            blocks[-1][1].append(text)
        else:
            blocks.append((line, [text]))
        last_line = line
    return [(line, "\n".join(texts)) for line, texts in blocks]


def _docstrings(source: str) -> list[tuple[int, str]]:
    """Every docstring and other bare string statement: (first line, text)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.append((node.lineno, node.value.value))
    return found


def history_in(source: str) -> list[tuple[int, str]]:
    """(line, phrase) of each history phrase in ``source``'s comments and docstrings."""
    hits = []
    for first_line, text in _comment_blocks(source) + _docstrings(source):
        for match in HISTORY.finditer(text):
            line = first_line + text.count("\n", 0, match.start())
            hits.append((line, " ".join(match.group().split())))
    return sorted(hits)


def test_no_comment_tells_the_codes_history() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {phrase!r}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, phrase in history_in(path.read_text())
    ]
    assert not found, "say why the code is as it is, not where it was:\n" + "\n".join(found)


def test_the_scan_finds_phrases_in_comments_and_docstrings_over_lines() -> None:
    source = (
        '"""A module.\n\nMoved out of ``state.py``."""\n'
        "x = 1  # keep: this comment says why\n"
        "# The link's logger: these lines were always\n"
        "# logged under its name.\n"
        "def f() -> None:\n"
        '    """Formerly ``g``."""\n'
        "y = 'formerly'  # a string that is data, not a docstring: not scanned\n"
    )
    assert history_in(source) == [
        (3, "Moved out of"),
        (5, "were always logged under"),
        (8, "Formerly"),
    ]


def test_why_comments_pass() -> None:
    source = (
        "# One logger for all of the link's parts (operators filter on this name).\n"
        "# Renamed into place only when the hash matches, so readers never see half a file.\n"
        "# The old leader's appends fail: fenced by the new one.\n"
        '"""Snapshot format 2 moved the digest to the header: readers accept 1 and 2."""\n'
    )
    assert history_in(source) == []
