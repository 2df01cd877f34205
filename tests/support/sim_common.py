"""What the seeded simulations (tests/sim) share: seeds from the environment, the failure
they raise, the encoding by which apply results are compared.

Seeds: ``STEWARD_SIM_SEEDS=N`` runs seeds 0..N-1 (``A:B`` runs A..B-1),
``STEWARD_SIM_SEED=n`` runs only seed n; without either, a simulation's default count.
"""

from __future__ import annotations

import os
from typing import NoReturn

import msgspec

from broker.core.state import ApplyResult


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


def encode_result(result: ApplyResult) -> bytes:
    return msgspec.msgpack.encode(result)


def steps(default: int) -> int:
    """A replicated simulation's schedule length: ``STEWARD_SIM_STEPS`` or the default."""
    return int(os.environ.get("STEWARD_SIM_STEPS", "") or default)


def entry_count(default: int) -> int:
    """A stream's length in entries: ``STEWARD_SIM_ENTRIES`` or the default."""
    return int(os.environ.get("STEWARD_SIM_ENTRIES", "") or default)
