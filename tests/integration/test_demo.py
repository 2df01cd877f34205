"""``steward demo``, the README's first command, works and exits 0; piped (as here), it
says what it does from its first seconds and shows progress as separate lines (issue 17,
friction 6)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import threading
import time

from clients.progress import PIPE_INTERVAL_S
from tests.support.procs import steward_command

DEMO_TIMEOUT_S = 300.0
# The first line comes before anything starts: only the interpreter's start-up is before it.
FIRST_LINE_S = 10.0
# While it works, no silence longer than this (the longest step, Spark, says so every 2 s).
MAX_SILENCE_S = 10.0
PROGRESS = re.compile(r"\] (\d+)/(\d+) tasks done, ([0-9.]+) s")


def test_steward_demo_runs_the_pyspark_word_count() -> None:
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)  # the demo must flush by itself when piped
    started = time.monotonic()
    proc = subprocess.Popen(
        [*steward_command(), "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    stderr_chunks: list[bytes] = []
    err = proc.stderr
    reader = threading.Thread(target=lambda: stderr_chunks.append(err.read()))
    reader.start()
    lines: list[tuple[float, str]] = []  # (seconds since start, line) as they arrived
    timer = threading.Timer(DEMO_TIMEOUT_S, proc.kill)  # bounded even if it hangs silently
    timer.start()
    try:
        for raw in proc.stdout:
            lines.append((time.monotonic() - started, raw.decode(errors="replace")))
        code = proc.wait(timeout=30)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(timeout=30)
    stdout = "".join(line for _, line in lines)
    stderr = b"".join(stderr_chunks).decode(errors="replace")
    output = stdout + stderr
    assert code == 0, output[-4000:]
    assert "both tenants' counts equal a plain-Python count of the corpus" in stdout
    assert "top words:" in stdout
    assert "tenant analytics" in stdout and "tenant adhoc" in stdout
    assert "Traceback" not in output and "Logging error" not in output, output[-4000:]

    # From the first seconds on, it says what it does (Spark's start announced).
    assert lines and lines[0][0] < FIRST_LINE_S, lines[:3]
    assert any("starting a standalone broker" in line for _, line in lines)
    first_done = next(i for i, (_, line) in enumerate(lines) if "tasks done" in line)
    assert any("Spark" in line for _, line in lines[:first_done]), stdout[:2000]
    gaps = [(b[0] - a[0], b[1]) for a, b in itertools.pairwise(lines)]
    assert max(gap for gap, _ in gaps) < MAX_SILENCE_S, gaps
    # Piped: progress as separate, spaced lines, no carriage-return redraws.
    assert "\r" not in stdout
    progress = [PROGRESS.search(line) for _, line in lines]
    shown = [(int(m[1]), int(m[2]), float(m[3])) for m in progress if m is not None]
    assert len(shown) >= 2, stdout[:3000]
    done, total, _ = shown[-1]
    assert done == total, shown
    # One line per PIPE_INTERVAL_S at most (by the elapsed time each line shows, to 0.1 s);
    # the last one, all done, comes when it comes.
    spacing = [b[2] - a[2] for a, b in itertools.pairwise(shown[:-1])]
    assert all(gap >= PIPE_INTERVAL_S - 0.15 for gap in spacing), shown
