"""The codebase stays ruff- and mypy --strict-clean: checked by the one test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return found


def _run(*command: str) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}"


def test_ruff_check() -> None:
    _run(_tool("ruff"), "check", ".")


def test_ruff_format() -> None:
    _run(_tool("ruff"), "format", "--check", ".")


def test_mypy_strict() -> None:
    _run(_tool("mypy"))
