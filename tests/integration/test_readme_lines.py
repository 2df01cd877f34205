"""The README's demo line, verbatim, in a fresh clone (issue 30): it sets up what it needs
(its own .venv in the clone) and runs the demo to its end. The README's test line is what
CI runs (.ci/run, held equal by tests/unit/test_deployment.py), so the suite's own run in
a fresh clone covers the second line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP_AND_DEMO_TIMEOUT_S = 900.0  # a virtualenv with pyspark, then the demo; bounded


def _readme_demo_line() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## The two commands")
    block = re.search(r"```sh\n(.*?)```", readme[start:], re.S)
    assert block is not None
    lines = [  # its excerpt marker left out (tests/integration/test_docs_run.py)
        line
        for line in block.group(1).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len(lines) == 1, lines
    return lines[0]


def _newcomer_env() -> dict[str, str]:
    """This environment as a fresh shell has it: no virtualenv of the suite's on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    ours = Path(sys.prefix).resolve()
    env["PATH"] = os.pathsep.join(
        entry
        for entry in env.get("PATH", "").split(os.pathsep)
        if entry and not Path(entry).resolve().is_relative_to(ours)
    )
    return env


def test_the_readme_demo_line_sets_up_and_runs_the_demo_in_a_fresh_clone() -> None:
    # Inside the checkout (.cache is git-ignored), so that task users reach the clone as
    # they reach this checkout; not under pytest's 0700 tmp root.
    cache = ROOT / ".cache"
    cache.mkdir(exist_ok=True)
    clone = Path(tempfile.mkdtemp(prefix="readme-clone-", dir=cache))
    try:
        os.chmod(clone, 0o755)
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
        result = subprocess.run(
            ["bash", "-c", _readme_demo_line()],
            cwd=clone,
            env=_newcomer_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SETUP_AND_DEMO_TIMEOUT_S,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        assert (clone / ".venv" / "bin" / "steward").exists()
        assert "both tenants' counts equal a plain-Python count of the corpus" in result.stdout
        assert "Traceback" not in output, output[-4000:]
    finally:
        shutil.rmtree(clone, ignore_errors=True)
