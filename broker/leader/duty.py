"""What a leader duty is: a job only the acting leader runs, for one term."""

from __future__ import annotations

from typing import Protocol


class LeaderDuty(Protocol):
    """Started when a term opens for writes, stopped at step-down (docs/DESIGN.md §4).

    ``stop`` ends everything ``start`` began, and is safe to call on a duty whose
    ``start`` raised part-way (:class:`~broker.leader.duties.LeaderDuties` calls it then).
    """

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
