"""The simulation's code-artifact entries (AddCode, CodeReady, DeleteCode): a part of
tests/support/sim_generator.py's EntryGenerator, which supplies ``rng``, ``view``,
``_time`` and ``_tenant``."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from broker.core import entries as e
from tests.support.sim_model import CODE_SHAS, CONFLICT, INVALID, NOT_FOUND, Expect

if TYPE_CHECKING:
    from broker.core import StateMachine


class CodeEntries:
    rng: random.Random
    view: StateMachine

    def _time(self) -> int:
        raise NotImplementedError

    def _tenant(self) -> str:
        raise NotImplementedError

    def _add_code(self) -> tuple[e.Entry, Expect]:
        rng = self.rng
        expect = Expect()
        sha = rng.choice(CODE_SHAS)
        if rng.random() < 0.2:
            sha = rng.choice(("", "xyz", "A" * 64, sha[:-1], sha + "0"))
            expect.reject[0] = INVALID
        else:
            expect.accept.add(0)
        entry = e.AddCode(
            time_ms=self._time(),
            sha256=sha,
            name="job.py",
            size_bytes=rng.randint(1, 10_000),
            ready=rng.random() < 0.4,
        )
        return entry, expect

    def _code_ready(self) -> tuple[e.Entry, Expect]:
        rng = self.rng
        expect = Expect()
        unready = sorted(sha for sha, a in self.view.artifacts.items() if not a.ready)
        sha = rng.choice(unready) if unready and rng.random() < 0.7 else rng.choice(CODE_SHAS)
        if rng.random() < 0.1:
            sha = rng.choice(("", "xyz", "A" * 64, sha + "0"))
            expect.reject[0] = INVALID
        elif sha not in self.view.artifacts:
            expect.reject[0] = NOT_FOUND
        else:
            expect.accept.add(0)
        return e.CodeReady(time_ms=self._time(), sha256=sha), expect

    def _delete_code(self) -> tuple[e.Entry, Expect]:
        """An admin's or a tenant's delete, or the leader's retention (docs/DESIGN.md §7).
        Only the certain outcomes are expected: the entry's clock advance may end tasks
        (deadlines) that use the artifact, which decides between conflict and success."""
        rng = self.rng
        expect = Expect()
        known = sorted(self.view.artifacts)
        sha = rng.choice(known) if known and rng.random() < 0.8 else rng.choice(CODE_SHAS)
        tenant = self._tenant() if rng.random() < 0.1 else None
        unused_for_ms = rng.choice((0, 0, 1, 5_000, 3_600_000))
        if rng.random() < 0.05:
            sha = rng.choice(("", "xyz", sha + "0"))
            expect.reject[0] = INVALID
        elif sha not in self.view.artifacts:
            expect.reject[0] = NOT_FOUND
        elif tenant is not None:
            expect.reject[0] = CONFLICT  # the sim's uploads are shared: an admin's to delete
        entry = e.DeleteCode(
            time_ms=self._time(), sha256=sha, tenant=tenant, unused_for_ms=unused_for_ms
        )
        return entry, expect
