"""Fixtures every test layer can use without importing them (docs/TESTING.md).

- ``zookeeper``, ``zookeeper_factory``, ``elector_process``: tests/support/zk_fixture.py
- ``pulsar_lite``, ``pulsar_lite_factory``: tests/support/pulsar_fixture.py
- ``make_broker``, ``broker`` (a Node with a WorkerLink on in-memory ledgers):
  tests/support/link_broker.py
- ``env`` (the authenticated HTTP API with a token per caller): tests/support/auth_env.py
- ``browser`` (headless Chromium, for the dashboard): tests/support/dashboard_browser.py

and ``STEWARD_TEST_BUSY_CORE=1`` (one core kept busy for the session): tests/support/busy_core.py

Each starts its server only when a test asks for it. A test module that defines a fixture
of the same name uses its own.
"""

import logging
import os
from collections.abc import Generator

import pytest

from clients.worker.task_processes.pool import disable_grpc_fork_handlers
from tests.support.tmp_dirs import use_own_tmpdir

# Two test processes run real-process tests at once (the lanes below): each its own TMPDIR.
if (_xdist_process := os.environ.get("PYTEST_XDIST_WORKER")) is not None:
    use_own_tmpdir(_xdist_process)

# Test workers run in this process beside the Spark Connect tests (grpc loaded): as a
# worker process does, keep grpc's fork handlers out of its task processes' forks.
disable_grpc_fork_handlers()

# Checks shared by test modules (not fixtures): their asserts explain failures too.
pytest.register_assert_rewrite("tests.support.ledger_lists")

pytest_plugins = [
    "tests.support.zk_fixture",
    "tests.support.pulsar_fixture",
    "tests.support.link_broker",
    "tests.support.auth_env",
    "tests.support.http_api",
    "tests.support.dashboard_browser",
    "tests.support.busy_core",
]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Each test leaves the root logger as it found it.

    A test that runs a command in-process (``cli.main(["standalone", ...])``) sets logging
    up for the whole process: a handler on the stderr pytest captured for that test, and
    INFO. Left there, every later record goes to a closed file, and at exit py4j's
    connection finalizers (after any test that used Spark) print "--- Logging error ---"
    tracebacks below the summary (issue 17, friction 6). Saved around the whole protocol,
    outside pytest's own per-phase capture handlers, so those are not restored stale.
    """
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return (yield)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


# Tests that start real servers and processes (ZooKeeper, brokers, workers, Spark, network
# namespaces) run in two lanes, each one test at a time in file order, the two lanes in the
# two xdist processes at once (each process its own TMPDIR: tests/support/tmp_dirs.py), the
# unit and simulation tests (in-process) filling in around them. The outage lane holds the
# tests whose bounds are about outages (kills, partitions, elections, a cluster under
# load): they never run beside one another, only beside one functional test. The tests
# of a lane share fixed names (the partition harness's namespaces; ports: locked). A
# scheduler of our own rather than xdist_group marks: pytest 9.2 dropped the node-id
# suffix that --dist loadgroup reads (pytest-xdist issue 1386).
_ONE_AT_A_TIME = ("integration", "chaos", "jepsen", "security")
_OUTAGE_DIRS = ("chaos", "jepsen")
_OUTAGE_MODULES = frozenset(
    f"tests/integration/test_{name}.py"
    for name in (
        "cluster_auth",
        "cluster_code",
        "cluster_failover",
        "cluster_up",
        "code_replication",
        "deposed_leader",
        "disconnected_worker",
        "durability",
        # Not an outage test: the longest (schemathesis' CPU), here to even the lanes out.
        "fuzz_http",
        "joins_after",
        "ledger_pulsar",
        "lost_worker",
        "newcomer_cluster_view",
        "producer_brokers",
        "pulsar_cluster_faults",
        "recovery",
        "schedules",
        "standalone_workers_restart",
        "take_over_zk_client",
        "tls",
        "tree_worker_kill",
        "webhooks_cluster",
        "zk_ensemble",
        "zookeeper",
    )
)
# Modules whose last test reads what the others did (the fuzz tests' input count): one unit.
_WHOLE_MODULES = ("tests/unit/test_fuzz_protocol.py",)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class RealProcessesOneAtATime(LoadScopeScheduling):
        """A unit of work per test, but one unit per lane of tests that start real processes."""

        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("/", 2)
            module = nodeid.split("::", 1)[0]
            if len(parts) == 3 and parts[0] == "tests" and parts[1] in _ONE_AT_A_TIME:
                outage = parts[1] in _OUTAGE_DIRS or module in _OUTAGE_MODULES
                return "real-processes-outages" if outage else "real-processes-functional"
            return module if module in _WHOLE_MODULES else nodeid

    return RealProcessesOneAtATime(config, log)
