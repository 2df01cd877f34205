"""The engines fetch (scripts/setup's ``steward_setup_engines``, issue 31): without Java or
Maven, or when Maven cannot resolve the pom, it stops the README's test line with one line
saying what to do, never a skip later; a complete cache is reused without Maven.

Each run sources the real scripts/setup in bash with a PATH of our own (stubs for ``java``
and ``mvn``), in a copy of the checkout's tests/engines, so no network and no JVM is used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What steward_setup_engines runs besides java and mvn.
_TOOLS = ("sed", "sha256sum", "cut", "cat", "mkdir", "rm", "mv", "tail", "printf")


def run_fetch(checkout: Path, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", "-c", "set -euo pipefail; . scripts/setup; steward_setup_engines"],
        cwd=checkout,
        env={"PATH": str(bin_dir), "HOME": str(checkout)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def make_checkout(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup", checkout / "scripts" / "setup")
    shutil.copytree(ROOT / "tests" / "engines", checkout / "tests" / "engines")
    return checkout


def make_bin(tmp_path: Path, stubs: dict[str, str]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in _TOOLS:
        found = shutil.which(tool)
        if found is not None:
            (bin_dir / tool).symlink_to(found)
    for name, body in stubs.items():
        stub = bin_dir / name
        stub.write_text(f"#!/bin/bash\n{body}\n")
        stub.chmod(0o755)
    return bin_dir


def pulsar_version() -> str:
    pom = (ROOT / "tests" / "engines" / "pom.xml").read_text()
    return pom.split("<pulsar.version>", 1)[1].split("</pulsar.version>", 1)[0]


def test_without_java_it_fails_with_one_line_saying_what_to_install(tmp_path: Path) -> None:
    result = run_fetch(make_checkout(tmp_path), make_bin(tmp_path, {"mvn": "exit 0"}))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "steward setup: no java on PATH: the suite runs Apache Pulsar on Java 17 "
        "(install openjdk-17-jre-headless)"
    ]


def test_without_maven_it_fails_with_one_line_saying_what_to_install(tmp_path: Path) -> None:
    result = run_fetch(make_checkout(tmp_path), make_bin(tmp_path, {"java": "exit 0"}))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "steward setup: no mvn on PATH: the suite fetches Apache Pulsar from Maven Central "
        "with Maven (install maven)"
    ]


def test_an_artifact_that_does_not_resolve_fails_and_leaves_no_cache(tmp_path: Path) -> None:
    checkout = make_checkout(tmp_path)
    failing_mvn = 'echo "[ERROR] Could not find artifact org.apache.pulsar:pulsar-broker"; exit 1'
    result = run_fetch(checkout, make_bin(tmp_path, {"java": "exit 0", "mvn": failing_mvn}))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert "[ERROR] Could not find artifact org.apache.pulsar:pulsar-broker" in lines
    assert lines[-1].startswith(
        f"steward setup: Maven could not resolve the engines of tests/engines/pom.xml "
        f"(Pulsar {pulsar_version()};"
    )
    assert not (checkout / ".cache" / "engines" / f"pulsar-{pulsar_version()}" / "lib").exists()


def test_a_complete_cache_is_reused_without_maven(tmp_path: Path) -> None:
    checkout = make_checkout(tmp_path)
    version = pulsar_version()
    # The stub copies what Maven would (the broker jar) into -DoutputDirectory, and counts.
    copying_mvn = (
        'for a in "$@"; do case $a in -DoutputDirectory=*) out=${a#*=};; esac; done\n'
        f'mkdir -p "$out" && : > "$out/pulsar-broker-{version}.jar" && echo run >> mvn-runs'
    )
    bin_dir = make_bin(tmp_path, {"java": "exit 0", "mvn": copying_mvn})
    first = run_fetch(checkout, bin_dir)
    assert first.returncode == 0, first.stderr
    lib = checkout / ".cache" / "engines" / f"pulsar-{version}" / "lib"
    assert (lib / f"pulsar-broker-{version}.jar").exists()
    pom_hash = hashlib.sha256((checkout / "tests" / "engines" / "pom.xml").read_bytes())
    assert (lib.parent / "lib.sha256").read_text().strip() == pom_hash.hexdigest()
    second = run_fetch(checkout, bin_dir)
    assert second.returncode == 0 and second.stderr == ""
    assert (checkout / "mvn-runs").read_text().count("run") == 1
    # A changed pom (another version pinned) fetches again.
    pom = checkout / "tests" / "engines" / "pom.xml"
    pom.write_text(pom.read_text() + "\n")
    assert run_fetch(checkout, bin_dir).returncode == 0
    assert (checkout / "mvn-runs").read_text().count("run") == 2
    assert set(os.listdir(lib.parent)) == {"lib", "lib.sha256"}
