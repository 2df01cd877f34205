"""Progress for the CLI and the demo: a redrawn bar on a terminal, periodic lines otherwise.

Piped into a file or another program, carriage returns would pile every redraw onto one
line; there a line is printed every ``interval_s`` while work goes on (also when nothing
finished meanwhile: the line says the work is alive) and always the last one.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

#: Seconds between progress lines when the output is not a terminal.
PIPE_INTERVAL_S = 5.0
#: Seconds between redraws of an unchanged bar on a terminal (its clock moves on).
TTY_REDRAW_S = 0.5


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream: plain lines
        return False


class Progress:
    """``[###---] done/total tasks done, N s``: redrawn in place on a terminal, else one
    line every ``interval_s`` seconds and one when done. Call :meth:`update` as often as
    convenient: it decides when to print."""

    def __init__(
        self,
        total: int,
        *,
        started: float | None = None,
        stream: TextIO | None = None,
        width: int = 30,
        interval_s: float = PIPE_INTERVAL_S,
    ) -> None:
        self.total = total
        self.started = time.monotonic() if started is None else started
        self.stream = stream if stream is not None else sys.stdout
        self.tty = _is_tty(self.stream)
        self.width = width
        self.interval_s = interval_s
        self._last_line: float | None = None  # when it last printed
        self._last_done = -1

    def line(self, done: int) -> str:
        filled = int(self.width * min(done, self.total) / max(1, self.total))
        elapsed = time.monotonic() - self.started
        bar = "#" * filled + "-" * (self.width - filled)
        return f"[{bar}] {done}/{self.total} tasks done, {elapsed:.1f} s"

    def update(self, done: int) -> None:
        finished = done >= self.total
        if finished and done == self._last_done:
            return  # the final line is out
        now = time.monotonic()
        since = None if self._last_line is None else now - self._last_line
        if self.tty:
            due = since is None or done != self._last_done or since >= TTY_REDRAW_S
        else:
            due = since is None or since >= self.interval_s
        if not (due or finished):
            return
        self._last_line, self._last_done = now, done
        if self.tty:
            end = "\n" if finished else ""
            print(f"\r{self.line(done)}", end=end, file=self.stream, flush=True)
        else:
            print(self.line(done), file=self.stream, flush=True)


def print_progress(done: int, total: int, started: float, width: int = 30) -> None:
    """Redraw ``[###---] done/total tasks done, N s`` on stdout; ends the line when done.
    Not on a terminal, each call prints a line (use :class:`Progress` to space them)."""
    Progress(total, started=started, width=width).update(done)
