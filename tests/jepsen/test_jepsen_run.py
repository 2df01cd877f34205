"""Short Jepsen runs (docs/TESTING.md, "Partitions"): the file ledger with a handful of
network, process and clock faults, and real Apache Pulsar with faults of the ledger engine
and the leader on a real Apache Pulsar cluster; the checker passes. ``STEWARD_JEPSEN_SEED``
picks the seed, ``STEWARD_JEPSEN_FAULTS`` the number of faults; ``STEWARD_JEPSEN_CI=1`` makes it the
CI-sized configuration instead (``python -m tests.jepsen --ci``: both ledger backends, 52
faults, under 10 minutes), which also asserts the fault mix, ledger rolls, snapshot
downloads and a zombie per paused worker. ``STEWARD_JEPSEN_PULSAR_FAULTS`` sets the number
of faults of the real-Pulsar run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.jepsen.cluster import BOOKIE_NODES
from tests.jepsen.history import NOT_FAULTS, History
from tests.jepsen.nemesis import NETWORK_FAULTS

ROOT = Path(__file__).resolve().parents[2]
CI = os.environ.get("STEWARD_JEPSEN_CI") == "1"
CI_BOUND_S = 600  # the acceptance's bound for the CI-sized run


@pytest.mark.slow
@pytest.mark.timeout(CI_BOUND_S + 120 if CI else 400)
def test_a_short_run_passes_the_checker() -> None:
    seed = os.environ.get("STEWARD_JEPSEN_SEED", "11")
    faults = os.environ.get("STEWARD_JEPSEN_FAULTS", "8")
    directory = Path(tempfile.mkdtemp(prefix="steward-jepsen-"))
    command = [sys.executable, "-m", "tests.jepsen", "--seed", seed]
    command += ["--ci", "--timeout-s", "400"] if CI else ["--faults", faults, "--timeout-s", "300"]
    result = subprocess.run(
        [*command, "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=CI_BOUND_S + 60 if CI else 360,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    output = result.stdout + result.stderr
    for line in output.splitlines():
        if line.startswith(("seed ", "checker passed", "jepsen")):
            print(line)  # the runs' summaries (pytest -s or -rP shows them)
    assert result.returncode == 0, output[-20_000:]
    faults_seen = [
        line.split()[2]
        for line in output.splitlines()
        if line.startswith("nemesis") and line.split()[2] not in NOT_FAULTS
    ]
    if CI:
        assert output.count("checker passed") == 2, output[-5000:]
        network = sum(kind in NETWORK_FAULTS for kind in faults_seen)
        assert network >= 30 and len(faults_seen) - network >= 20, faults_seen
        # Ledger rolls and snapshot downloads each happened in both runs (the summary's
        # counters), and every paused worker (its replacement seen to start while it was
        # paused: the nemesis holds it until then) made a zombie the checker passed.
        counters = re.findall(r"'(ledger rolls|snapshot downloads)': (\d+)", output)
        assert len(counters) == 4 and all(int(n) > 0 for _, n in counters), counters
        pauses = faults_seen.count("pause-worker")
        arranged = [int(n) for n in re.findall(r"'zombies arranged': (\d+)", output)]
        zombies = [int(n) for n in re.findall(r"'zombie attempts': (\d+)", output)]
        assert pauses > 0 and sum(arranged) == pauses, (pauses, arranged)
        assert all(z >= a for z, a in zip(zombies, arranged, strict=True)), (zombies, arranged)
    else:
        assert "checker passed" in output
        assert len(faults_seen) == int(faults), output[-5000:]
    shutil.rmtree(directory)  # kept when the run failed: its logs and history.jsonl


# Issue 31, item 5's faults of the real Pulsar cluster, and the leader fault that matters on
# it: the Pulsar broker cut from Steward's leader, killed -9 and paused; a bookie cut from the
# Pulsar broker, killed -9 and paused; the leader paused past its session (the engine fences
# its late appends). One round of these is 9 faults (a network kind twice): each kind runs.
PULSAR_KINDS = (
    "leader-from-ledger,kill-pulsar,stop-pulsar,bookie-from-pulsar,kill-bookie,stop-bookie,"
    "stop-leader"
)
PULSAR_ROUND = 9


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_run_on_apache_pulsar_passes_the_checker() -> None:
    """Issue 31, item 5: Steward's brokers on a real Apache Pulsar cluster (three bookies
    journalling with fsync and one Pulsar broker, each in a network namespace of its own;
    tests/jepsen/cluster.py), with ``--pulsar-flavor pulsar`` (the engine fences a deposed
    leader's producer). The run's history holds every kind asked for, each bookie fault
    names the bookie it hit, and a bookie killed while it held the newest ledger made the
    Pulsar broker change that ledger's ensemble."""
    seed = os.environ.get("STEWARD_JEPSEN_SEED", "5")
    faults = int(os.environ.get("STEWARD_JEPSEN_PULSAR_FAULTS", str(PULSAR_ROUND)))
    directory = Path(tempfile.mkdtemp(prefix="steward-jepsen-"))
    command = [
        sys.executable, "-m", "tests.jepsen", "--seed", seed, "--faults", str(faults),
        "--ledger", "apache-pulsar", "--kinds", PULSAR_KINDS, "--timeout-s", "480",
        "--dir", str(directory),
    ]  # fmt: skip
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    output = result.stdout + result.stderr
    for line in output.splitlines():
        if line.startswith(("seed ", "checker passed", "jepsen", "nemesis")):
            print(line)  # the summary and every fault injected (pytest -s or -rP shows them)
    assert result.returncode == 0, output[-20_000:]
    assert "checker passed" in output and "ledger apache-pulsar" in output, output[-5000:]
    # The faults as the checker saw them: the run's history.
    injected = [
        event
        for event in History.load(directory / "history.jsonl").nemesis
        if event.action not in NOT_FAULTS
    ]
    kinds = [event.action for event in injected]
    assert len(kinds) == faults and set(kinds) <= set(PULSAR_KINDS.split(",")), kinds
    if faults >= PULSAR_ROUND:
        assert set(kinds) == set(PULSAR_KINDS.split(",")), kinds
    bookie_faults = [e for e in injected if "bookie" in e.action]
    assert all(e.detail["bookie"] in BOOKIE_NODES for e in bookie_faults), bookie_faults
    changes = re.search(r"'ensemble changes': (\d+)", output)
    assert changes is not None, output[-5000:]
    if any(e.action == "kill-bookie" and e.detail["in_newest_ensemble"] for e in injected):
        assert int(changes.group(1)) > 0, output[-5000:]
    shutil.rmtree(directory)
