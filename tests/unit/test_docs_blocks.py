"""The docs' code blocks say what they are (issue 30, "Docs that run"): every fence of
README.md and docs/*.md names its language, and a block that looks runnable but is not run
by tests/integration/test_docs_run.py says why, and which test runs the real thing. And
docs/CLIENT.md, the Python client's reference, names every public method of the client's
classes (introspected) and every name the package exports."""

from __future__ import annotations

import inspect
import re

import clients.client as client_package
from clients.client import (
    AsyncProducer,
    AsyncStewardClient,
    AsyncTaskHandle,
    AsyncTransaction,
    Producer,
    StewardClient,
    TaskHandle,
    Transaction,
)
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
    assert any(block.path == "docs/CLIENT.md" for block in running)


# --- docs/CLIENT.md, the client reference ---------------------------------------------------

CLIENT_DOC = ROOT / "docs" / "CLIENT.md"
# Each class the reference documents member by member, and the async twin that has the
# same members awaited except where its own section says otherwise.
SYNC_CLASSES = (StewardClient, TaskHandle, Transaction, Producer)
ASYNC_TWINS = {
    AsyncStewardClient: StewardClient,
    AsyncTaskHandle: TaskHandle,
    AsyncTransaction: Transaction,
    AsyncProducer: Producer,
}


def _public_members(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def _section(title: str) -> str:
    """The text of docs/CLIENT.md's ``## `title```-headed section (up to the next ``## ``)."""
    text = CLIENT_DOC.read_text(encoding="utf-8")
    found = re.search(rf"^## `{title}`[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found is not None, f"docs/CLIENT.md has no section ## `{title}`"
    return found.group(1)


def _parameters(member: object) -> list[str] | None:
    try:
        return list(inspect.signature(member).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # a property


def test_the_client_reference_names_every_public_method() -> None:
    for cls in SYNC_CLASSES:
        section = _section(cls.__name__)
        missing = [
            name
            for name in sorted(_public_members(cls))
            if not re.search(rf"^- `{name}[(`]", section, re.M)
        ]
        assert not missing, f"docs/CLIENT.md, ## `{cls.__name__}`: no `- `name(...)`` for {missing}"


def test_the_async_twins_are_the_sync_methods_awaited_or_say_where_they_differ() -> None:
    async_section = _section("AsyncStewardClient")
    for twin, sync in ASYNC_TWINS.items():
        for name in sorted(_public_members(twin) | _public_members(sync)):
            same = (
                name in _public_members(twin)
                and name in _public_members(sync)
                and _parameters(getattr(twin, name)) == _parameters(getattr(sync, name))
            )
            if not same:
                assert f"`{name}(" in async_section, (
                    f"{twin.__name__}.{name} differs from {sync.__name__}'s (missing, or other "
                    f"parameters): docs/CLIENT.md, ## `AsyncStewardClient`, must say how"
                )


def test_the_client_reference_names_every_exported_name() -> None:
    text = CLIENT_DOC.read_text(encoding="utf-8")
    missing = [name for name in client_package.__all__ if f"`{name}" not in text]
    assert not missing, f"docs/CLIENT.md does not name {missing}"


def test_the_readme_and_the_api_reference_link_the_client_reference() -> None:
    assert "[docs/CLIENT.md](docs/CLIENT.md)" in (ROOT / "README.md").read_text()
    assert "CLIENT.md" in (ROOT / "docs" / "API.md").read_text()
