"""A one-line progress bar for the CLI and the demo."""

from __future__ import annotations

import time


def print_progress(done: int, total: int, started: float, width: int = 30) -> None:
    """Redraw ``[###---] done/total tasks done, N s``; ends the line when done."""
    filled = int(width * done / max(1, total))
    elapsed = time.monotonic() - started
    bar = "#" * filled + "-" * (width - filled)
    end = "\n" if done >= total else ""
    print(f"\r[{bar}] {done}/{total} tasks done, {elapsed:.1f} s", end=end, flush=True)
