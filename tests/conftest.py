"""Fixtures every test layer can use without importing them (docs/TESTING.md).

- ``zookeeper``, ``zookeeper_factory``, ``elector_process``: tests/support/zk_fixture.py
- ``pulsar_lite``, ``pulsar_lite_factory``: tests/support/pulsar_fixture.py
- ``make_broker``, ``broker`` (a Node with a WorkerLink on in-memory ledgers):
  tests/support/link_broker.py
- ``env`` (the authenticated HTTP API with a token per caller): tests/support/auth_env.py
- ``browser`` (headless Chromium, for the dashboard): tests/support/dashboard_browser.py

Each starts its server only when a test asks for it. A test module that defines a fixture
of the same name uses its own.
"""

import logging
from collections.abc import Generator
from pathlib import Path

import pytest

# Checks shared by test modules (not fixtures): their asserts explain failures too.
pytest.register_assert_rewrite("tests.support.ledger_lists")

pytest_plugins = [
    "tests.support.zk_fixture",
    "tests.support.pulsar_fixture",
    "tests.support.link_broker",
    "tests.support.auth_env",
    "tests.support.http_api",
    "tests.support.dashboard_browser",
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
# namespaces) run one at a time: they share fixed names (worker ids and so their work dirs,
# the harness's namespaces), and their timing bounds assume no second cluster beside them.
# Unit and simulation tests (in-process) run beside them, in the other xdist process.
_ONE_AT_A_TIME = ("integration", "chaos", "jepsen", "security")
_TESTS_DIR = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        layer = Path(item.path).relative_to(_TESTS_DIR).parts[0]
        if layer in _ONE_AT_A_TIME:
            item.add_marker(pytest.mark.xdist_group("real-processes"))
