"""Fixtures every test layer can use without importing them.

- ``zookeeper``, ``zookeeper_factory``, ``elector_process``: tests/support/zk_fixture.py
- ``pulsar_lite``, ``pulsar_lite_factory``: tests/support/pulsar_fixture.py

Each starts its server only when a test asks for it. Fixtures still imported by hand from
test modules (``broker``/``make_broker`` from tests/unit/test_worker_link.py, ``env`` from
tests/unit/test_auth.py) move here with their helper classes in a later step.
"""

pytest_plugins = ["tests.support.zk_fixture", "tests.support.pulsar_fixture"]
