"""docs/CONFIGURATION.md names every flag (with its default) and every environment variable."""

from __future__ import annotations

import re
from pathlib import Path

from clients.cli import flag_docs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "CONFIGURATION.md"
# Variables only the test suite reads (documented in docs/TESTING.md).
_TEST_ONLY = re.compile(r"STEWARD_(SIM|FUZZ|CHAOS|SOAK)_")


def test_the_flag_reference_is_rendered_from_the_parsers() -> None:
    text = DOC.read_text()
    start, end = text.find(flag_docs.BEGIN), text.find(flag_docs.END)
    assert start >= 0 and end > start, "docs/CONFIGURATION.md lost its generated flag section"
    documented = text[start : end + len(flag_docs.END)] + "\n"
    assert documented == flag_docs.render(), (
        "docs/CONFIGURATION.md disagrees with the parsers: "
        "regenerate with `python -m clients.cli.flag_docs`"
    )


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    used: set[str] = set()
    for package in ("broker", "clients", "log", "snapshot"):
        for path in (ROOT / package).rglob("*.py"):
            used.update(re.findall(r"STEWARD_[A-Z_]*[A-Z]", path.read_text()))
    used = {name for name in used if not _TEST_ONLY.match(name)}
    assert used, "found no STEWARD_* variable in the code: the scan is broken"
    text = DOC.read_text()
    missing = sorted(name for name in used if f"`{name}`" not in text)
    assert not missing, f"not in docs/CONFIGURATION.md's environment table: {missing}"
