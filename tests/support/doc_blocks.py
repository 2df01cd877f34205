"""The fenced code blocks of README.md and docs/*.md, for the tests that hold the docs to
what runs (tests/unit/test_docs_blocks.py, tests/integration/test_docs_run.py).

A block whose language is ``python``, ``sh`` or ``bash`` runs, unless its first line is an
excerpt marker, ``# excerpt: <why it does not run here, and which test runs the real
thing>``. Every other block (``text``, ``http``, ``console``, ``mermaid``, ...) is output,
a request or a diagram and is not run; every fence names its language.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE_LANGUAGES = frozenset({"python", "sh", "bash"})
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_EXCERPT = re.compile(r"^#\s*excerpt:(?P<why>.*)$")


@dataclass(frozen=True)
class DocBlock:
    path: str  # relative to the repository root
    line: int  # the opening fence's line, from 1
    info: str  # the fence's info string ("" when it has none)
    text: str  # the block's lines, each ending with a newline

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.strip() else ""

    @property
    def excerpt_reason(self) -> str | None:
        """What the excerpt marker on the first line says (None: the block has none)."""
        first = self.text.splitlines()[0].strip() if self.text.strip() else ""
        found = _EXCERPT.match(first)
        return found.group("why").strip() if found else None

    @property
    def runs(self) -> bool:
        return self.language in RUNNABLE_LANGUAGES and self.excerpt_reason is None


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(path: Path) -> list[DocBlock]:
    """Every fenced block of one Markdown file; an unclosed fence is an error."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    found: list[DocBlock] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index].rstrip("\n"))
        if opening is None:
            index += 1
            continue
        fence = opening.group("fence")
        body: list[str] = []
        end = index + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end].rstrip("\n"))
            if (
                closing is not None
                and closing.group("fence")[0] == fence[0]
                and len(closing.group("fence")) >= len(fence)
                and not closing.group("info").strip()
            ):
                break
            body.append(lines[end])
            end += 1
        else:
            raise AssertionError(f"{path.relative_to(ROOT)}:{index + 1}: the fence is never closed")
        found.append(
            DocBlock(
                str(path.relative_to(ROOT)), index + 1, opening.group("info").strip(), "".join(body)
            )
        )
        index = end + 1
    return found


def all_blocks() -> list[DocBlock]:
    return [block for path in doc_files() for block in blocks_of(path)]
