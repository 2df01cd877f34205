"""What the seeded simulations (tests/sim) share: seeds from the environment, the failure
they raise, the check that their runs exercised what they should, the encoding by which
apply results are compared.

Seeds: ``STEWARD_SIM_SEEDS=N`` runs seeds 0..N-1 (``A:B`` runs A..B-1),
``STEWARD_SIM_SEED=n`` runs only seed n; without either, a simulation's default count.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NoReturn

import msgspec
import pytest

from broker.core import ApplyResult


def seeds(default: int) -> list[int]:
    one = os.environ.get("STEWARD_SIM_SEED", "").strip()
    if one:
        return [int(one)]
    spec = os.environ.get("STEWARD_SIM_SEEDS", "").strip()
    if not spec:
        return list(range(default))
    if ":" in spec:
        start, stop = spec.split(":", 1)
        return list(range(int(start), int(stop)))
    return list(range(int(spec)))


class SimulationFailure(AssertionError):
    pass


def fail(message: str) -> NoReturn:
    raise SimulationFailure(message)


def stats_or_fail(run: Callable[[], Counter[str]]) -> Counter[str]:
    """``run()``'s stats; a SimulationFailure fails the test with just its (self-contained)
    message: seed, step and how to reproduce, no traceback."""
    try:
        return run()
    except SimulationFailure as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)


def assert_exercised(stats: Counter[str], wanted: Iterable[str]) -> None:
    """Every counter in ``wanted`` is above zero: the runs really produced what their checks
    are about (guards the driver, not the system)."""
    missing = [name for name in wanted if stats[name] == 0]
    assert not missing, f"never exercised: {missing}; stats: {dict(stats)}"


def encode_result(result: ApplyResult) -> bytes:
    return msgspec.msgpack.encode(result)


def steps(default: int) -> int:
    """A replicated simulation's schedule length: ``STEWARD_SIM_STEPS`` or the default."""
    return int(os.environ.get("STEWARD_SIM_STEPS", "") or default)


def entry_count(default: int) -> int:
    """A stream's length in entries: ``STEWARD_SIM_ENTRIES`` or the default."""
    return int(os.environ.get("STEWARD_SIM_ENTRIES", "") or default)
