"""Every repository path the docs and the code name exists (files move; the docs stay true)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_PATH = re.compile(
    r"((?:broker|clients|log|snapshot|tests|bench|examples|docs)/[\w/.\-]+?\.(?:py|md|sh|yml|toml))"
)
# Files whose path strings are test data (planted imports and writers), not references.
_DATA = {ROOT / "tests" / "unit" / name for name in ("test_layering.py", "test_node_interface.py")}


def _referencing_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for package in ("broker", "clients", "log", "snapshot", "tests", "bench", "examples"):
        files += sorted((ROOT / package).rglob("*.py"))
    return [path for path in files if path not in _DATA]


def test_every_named_path_exists() -> None:
    missing = [
        f"{path.relative_to(ROOT)}: {found}"
        for path in _referencing_files()
        for found in _PATH.findall(path.read_text())
        if not (ROOT / found).exists()
    ]
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)
