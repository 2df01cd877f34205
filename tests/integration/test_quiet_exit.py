"""A pytest run that used Spark ends with its summary: no "--- Logging error ---" traceback
from py4j's connection finalizers at exit (issue 17, friction 6).

The run pairs the smallest in-process Spark test with a test that sets process-wide
logging up through the CLI (onto the stderr pytest captured for it): without the root
logger restored after each test (tests/conftest.py), py4j's "Closing down clientserver
connection" at exit goes to that closed file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240.0
TESTS = (
    "tests/unit/test_tls_contexts.py::test_cli_broker_commands_need_certificate_and_key",
    "tests/integration/test_worker_spark.py::test_spark_sql_returns_rows_as_json_objects",
)


def test_a_pytest_run_with_spark_ends_without_logging_errors() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=RUN_TIMEOUT_S,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "2 passed" in run.stdout, output[-4000:]
    assert "Logging error" not in output and "Traceback" not in output, output[-4000:]
