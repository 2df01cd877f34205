"""The docs' code blocks say what they are (issue 30, "Docs that run"): every fence of
README.md and docs/*.md names its language, and a block that looks runnable but is not run
by tests/integration/test_docs_run.py says why, and which test runs the real thing."""

from __future__ import annotations

import re

from tests.support.doc_blocks import ROOT, RUNNABLE_LANGUAGES, all_blocks

# A reason worth the name: a few words, not "todo".
MIN_EXCERPT_REASON_WORDS = 4


def test_every_fence_names_its_language() -> None:
    unlabeled = [block.id for block in all_blocks() if not block.language]
    assert not unlabeled, (
        f"fences without an info string (```text, ```http, ```console, ```mermaid for "
        f"output, requests and diagrams; ```python or ```sh for what runs): {unlabeled}"
    )


def test_every_excerpt_says_why_and_names_a_test_when_one_runs_it() -> None:
    for block in all_blocks():
        reason = block.excerpt_reason
        if reason is None:
            continue
        assert block.language in RUNNABLE_LANGUAGES, f"{block.id}: only runnable blocks"
        assert len(reason.split()) >= MIN_EXCERPT_REASON_WORDS, f"{block.id}: {reason!r}"
        for named in re.findall(r"tests/[\w/]+\.py", reason):
            assert (ROOT / named).is_file(), f"{block.id} names {named}, which does not exist"


def test_the_docs_have_blocks_that_run() -> None:
    # The extraction itself: a regression here would silently run nothing.
    running = [block for block in all_blocks() if block.runs]
    assert any(block.path == "README.md" and block.language == "sh" for block in running)
    assert any(block.path == "docs/API.md" and block.language == "python" for block in running)
