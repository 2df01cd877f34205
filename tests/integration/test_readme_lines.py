"""The README's demo line, verbatim, in a fresh clone (issues 17 and 30): it sets up what it
needs (its own .venv in the clone), runs the demo to its end and exits 0; piped (as here), it
says what it does from its first seconds, is never silent for long once the demo runs, and
shows progress as separate lines. The README's test line is what CI runs (.ci/run, held
equal by tests/unit/test_deployment.py), so the suite's own run in a fresh clone covers the
second line."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from clients.progress import PIPE_INTERVAL_S

ROOT = Path(__file__).resolve().parents[2]
SETUP_AND_DEMO_TIMEOUT_S = 900.0  # a virtualenv with pyspark, then the demo; bounded
# The first line comes before anything is set up or started.
FIRST_LINE_S = 10.0
# Once the demo runs, no silence longer than this (the longest step, Spark, says so every
# 2 s); setting up says each step before it starts, but pip is silent while it installs.
MAX_SILENCE_S = 10.0
DEMO_FIRST_LINE = "steward demo: data dir"
PROGRESS = re.compile(r"\] (\d+)/(\d+) tasks done, ([0-9.]+) s")


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
    """This environment as a fresh shell has it: no virtualenv of the suite's on PATH, and
    no PYTHONUNBUFFERED (the demo must flush by itself when piped)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONUNBUFFERED")
    }
    ours = Path(sys.prefix).resolve()
    env["PATH"] = os.pathsep.join(
        entry
        for entry in env.get("PATH", "").split(os.pathsep)
        if entry and not Path(entry).resolve().is_relative_to(ours)
    )
    return env


def _run_timed(command: str, cwd: Path) -> tuple[int, list[tuple[float, str]]]:
    """Runs ``command`` with stdout and stderr on one pipe; its exit code and each line with
    the seconds since the start at which it arrived. Killed after the timeout."""
    started = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=_newcomer_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its process group: what a failed test kills
    )
    assert proc.stdout is not None

    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    lines: list[tuple[float, str]] = []
    timer = threading.Timer(SETUP_AND_DEMO_TIMEOUT_S, kill_group)  # bounded even if silent
    timer.start()
    try:
        for raw in proc.stdout:
            lines.append((time.monotonic() - started, raw.decode(errors="replace")))
        code = proc.wait(timeout=30)
    finally:
        timer.cancel()
        # The demo's broker and worker too, if the test ends early (its own timeout).
        kill_group()
        proc.wait(timeout=10)
    return code, lines


# pytest-timeout's default (300 s) is shorter than the setup's own bound.
@pytest.mark.timeout(SETUP_AND_DEMO_TIMEOUT_S + 60)
def test_the_readme_demo_line_sets_up_and_runs_the_demo_in_a_fresh_clone() -> None:
    # Inside the checkout (.cache is git-ignored), so that task users reach the clone as
    # they reach this checkout; not under pytest's 0700 tmp root.
    cache = ROOT / ".cache"
    cache.mkdir(exist_ok=True)
    clone = Path(tempfile.mkdtemp(prefix="readme-clone-", dir=cache))
    try:
        os.chmod(clone, 0o755)
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
        code, lines = _run_timed(_readme_demo_line(), clone)
        output = "".join(line for _, line in lines)
        assert code == 0, output[-4000:]
        assert (clone / ".venv" / "bin" / "steward").exists()
        assert "both tenants' counts equal a plain-Python count of the corpus" in output
        assert "top words:" in output
        assert "tenant analytics" in output and "tenant adhoc" in output
        assert "Traceback" not in output and "Logging error" not in output, output[-4000:]
    finally:
        shutil.rmtree(clone, ignore_errors=True)

    # From its first seconds on, it says what it does: setting up (a fresh clone has no
    # .venv), then each step of the demo, Spark's start announced before the first result.
    assert lines and lines[0][0] < FIRST_LINE_S, lines[:3]
    demo_start = next(i for i, (_, line) in enumerate(lines) if line.startswith(DEMO_FIRST_LINE))
    demo = lines[demo_start:]
    assert any("starting a standalone broker" in line for _, line in demo)
    first_done = next(i for i, (_, line) in enumerate(demo) if "tasks done" in line)
    assert any("Spark" in line for _, line in demo[:first_done]), output[:3000]
    gaps = [(b[0] - a[0], b[1]) for a, b in itertools.pairwise(demo)]
    assert max(gap for gap, _ in gaps) < MAX_SILENCE_S, gaps
    # Piped: progress as separate, spaced lines, no carriage-return redraws.
    assert "\r" not in output
    progress = [PROGRESS.search(line) for _, line in demo]
    shown = [(int(m[1]), int(m[2]), float(m[3])) for m in progress if m is not None]
    assert len(shown) >= 2, output[:3000]
    done, total, _ = shown[-1]
    assert done == total, shown
    # One line per PIPE_INTERVAL_S at most (by the elapsed time each line shows, to 0.1 s);
    # the last one, all done, comes when it comes.
    spacing = [b[2] - a[2] for a, b in itertools.pairwise(shown[:-1])]
    assert all(gap >= PIPE_INTERVAL_S - 0.15 for gap in spacing), shown
