"""clients/progress.py: a redrawn bar on a terminal, spaced plain lines when piped."""

from __future__ import annotations

import io

import pytest

import clients.progress as progress_module
from clients.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", fake)
    return fake


def test_piped_progress_prints_spaced_lines_and_always_the_last(clock: Clock) -> None:
    out = io.StringIO()
    bar = Progress(10, stream=out, interval_s=5.0)
    for done, at in [(1, 0.0), (2, 1.0), (3, 4.9), (3, 5.0), (4, 7.0), (4, 10.1), (10, 10.5)]:
        clock.now = 100.0 + at
        bar.update(done)
    bar.update(10)  # the final line is not repeated
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split("] ")[1] for line in lines] == [
        "1/10 tasks done, 0.0 s",
        "3/10 tasks done, 5.0 s",  # nothing new at 5 s still gets a line: it is alive
        "4/10 tasks done, 10.1 s",
        "10/10 tasks done, 10.5 s",
    ]


def test_terminal_progress_redraws_in_place_and_ends_the_line(clock: Clock) -> None:
    out = Terminal()
    bar = Progress(2, stream=out)
    bar.update(1)
    clock.now += 0.1
    bar.update(1)  # unchanged and soon: no redraw
    bar.update(2)
    assert out.getvalue().count("\r") == 2
    assert out.getvalue().endswith("2/2 tasks done, 0.1 s\n")
