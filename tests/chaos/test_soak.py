"""Issue 7, acceptance 3, and issue 19 item 5: the chaos soak, CI version (60 faults, about
4 minutes); issue 31 item 5: its real-Pulsar variant (:data:`PULSAR_FAULTS` faults on an
Apache Pulsar standalone, the engine killed and paused among them).

The seed comes from ``STEWARD_CHAOS_SEED`` (else a fixed default) and is printed with the
fault log; rerun one run with ``STEWARD_CHAOS_SEED=<seed>``, or the long version with
``python -m tests.chaos.soak --seed <seed> --faults 500``. See :mod:`tests.chaos.soak` for
what the faults are and what is checked afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from clients.dev.zk import ZooKeeperServer
from tests.chaos.soak import ChaosSoak, run_soak
from tests.chaos.soak_parts import SoakConfig, SoakResult

DEFAULT_SEED = 20261122
CI_FAULTS = 60
#: The real-Pulsar variant: fewer faults (each kill of the engine costs its JVM's restart,
#: 20-25 s), ``STEWARD_CHAOS_PULSAR_FAULTS`` for more.
PULSAR_FAULTS = 30


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_soak(zookeeper_factory: Callable[[], ZooKeeperServer], tmp_path: Path) -> None:
    seed = int(os.environ.get("STEWARD_CHAOS_SEED", DEFAULT_SEED))
    print(f"\nchaos soak seed: {seed} (rerun with STEWARD_CHAOS_SEED={seed})")
    config = SoakConfig(seed=seed, faults=CI_FAULTS)
    result = ChaosSoak(config, zookeeper_factory(), tmp_path).run()
    assert_exercised(result)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_soak_on_apache_pulsar(
    zookeeper_factory: Callable[[], ZooKeeperServer], tmp_path: Path
) -> None:
    """Brokers with ``--pulsar-flavor pulsar`` (the engine fences a deposed leader) on a
    standalone (broker and bookie in one JVM, journal fsync on) that the schedule kills -9
    and pauses besides the cluster's own faults."""
    seed = int(os.environ.get("STEWARD_CHAOS_SEED", DEFAULT_SEED))
    faults = int(os.environ.get("STEWARD_CHAOS_PULSAR_FAULTS", PULSAR_FAULTS))
    print(f"\nchaos soak seed: {seed} (rerun with STEWARD_CHAOS_SEED={seed})")
    config = SoakConfig(seed=seed, faults=faults, ledgers="apache-pulsar")
    result = run_soak(config, tmp_path, zookeeper=zookeeper_factory())
    assert_exercised(result)
    engine_faults = result.faults["kill_pulsar"] + result.faults["stop_pulsar"]
    assert engine_faults > 0, f"the engine was never faulted: {result.summary()}"


def assert_exercised(result: SoakResult) -> None:
    # run() fails on every check (tests/chaos/soak.py); these say what the run exercised,
    # which depends on its timing, not on the schedule: each can fail.
    counts = result.counts
    for name in ("zombie_overlaps", "ledger_rolls", "retention_deletes", "snapshot_downloads"):
        assert counts[name] > 0, f"no {name}: {result.summary()}"
    assert counts["leader_outages"] > 0, f"no outage of the leader measured: {result.summary()}"
    assert set(result.states) <= {"finished", "cancelled"}, result.summary()
