"""``steward demo``, the README's first command, works and exits 0."""

from __future__ import annotations

import subprocess

from tests.support.procs import steward_command


def test_steward_demo_runs_the_pyspark_word_count() -> None:
    result = subprocess.run(
        [*steward_command(), "demo"], capture_output=True, text=True, timeout=300, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "both tenants' counts equal a plain-Python count of the corpus" in result.stdout
    assert "top words:" in result.stdout
    assert "tenant analytics" in result.stdout and "tenant adhoc" in result.stdout
    assert "Traceback" not in output
