"""Watching a ``steward cluster up`` process from a test: its output read on a thread until
it says "cluster up", and the processes it started (found under /proc)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path


class ClusterUpOutput:
    """The lines ``proc`` prints (stdout, text mode), read on a daemon thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.up = threading.Event()  # set once it printed "cluster up"
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("cluster up"):
                self.up.set()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_up(self, timeout_s: float) -> str:
        """Everything printed up to "cluster up"; fails after ``timeout_s``."""
        assert self.up.wait(timeout_s), "cluster up did not come up:\n" + self.text()
        return self.text()


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (its children start their own sessions)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except FileNotFoundError:
            continue
        for child in map(int, children):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found
