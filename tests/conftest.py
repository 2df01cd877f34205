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
