"""docker-compose.yml, the Dockerfile and docs/OPERATIONS.md describe one deployment.

No Docker engine is needed: the compose file is checked as data here, against the real CLI
parsers, and validated by a real Compose implementation (`docker-compose config`) when one is
installed (always in CI: the README's test line, scripts/test, installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from clients import cli
from clients.dev.pulsar_standalone import pulsar_version
from clients.worker.__main__ import build_parser as build_worker_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"  # the deployment guide

BROKERS = ("broker-1", "broker-2", "broker-3")
WORKERS = ("worker-1", "worker-2")
SERVICES = {
    "zookeeper",
    "pulsar",
    "pulsar-init",
    *BROKERS,
    *WORKERS,
    "spark-master",
    "spark-worker",
}
ONE_SHOT = {"pulsar-init"}  # runs to completion; everything else is long-running


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _services() -> dict[str, dict[str, Any]]:
    services = _compose()["services"]
    assert isinstance(services, dict)
    return services


def _command(service: str) -> list[str]:
    command = _services()[service]["command"]
    assert isinstance(command, list), f"{service}: command must be a list (exec form)"
    return [str(part) for part in command]


def _flags(command: list[str]) -> dict[str, str]:
    """``--name=value`` and ``--name value`` arguments as {name: value} (last one wins)."""
    flags: dict[str, str] = {}
    i = 0
    while i < len(command):
        part = command[i]
        if part.startswith("--"):
            name, sep, value = part.partition("=")
            if not sep and i + 1 < len(command) and not command[i + 1].startswith("--"):
                value = command[i + 1]
                i += 1
            flags[name] = value
        i += 1
    return flags


def _default(expression: str) -> str:
    """The default of a compose ``${VAR:-default}`` expression."""
    match = re.search(r"\$\{\w+:-([^}]+)\}", expression)
    assert match, f"expected ${{VAR:-default}} in {expression!r}"
    return match.group(1)


def _published_ports() -> dict[str, list[int]]:
    ports: dict[str, list[int]] = {}
    for name, service in _services().items():
        for spec in service.get("ports", []):
            host, _, _container = str(spec).rpartition(":")
            ports.setdefault(name, []).append(int(host.rpartition(":")[2]))
    return ports


def _broker_url(service: str) -> str:
    return f"http://{_flags(_command(service))['--http']}"


# --- the compose file ------------------------------------------------------------------------


def test_compose_has_exactly_the_documented_services() -> None:
    assert set(_services()) == SERVICES


def test_brokers_use_pulsar_ledgers_with_distinct_ids_ports_and_volumes() -> None:
    ids, volumes, urls = set(), set(), set()
    for name in BROKERS:
        flags = _flags(_command(name))
        assert _command(name)[0] == "broker"
        assert flags["--ledgers"] == "pulsar", name
        assert flags["--pulsar-url"] == "pulsar://pulsar:6650", name
        assert flags["--pulsar-admin-url"] == "http://pulsar:8080", name
        assert (flags["--pulsar-tenant"], flags["--pulsar-namespace"]) == ("public", "steward")
        assert "--ledger-dir" not in flags, f"{name}: no shared ledger dir with --ledgers pulsar"
        assert flags["--zookeeper"] == "zookeeper:2181", name
        assert flags["--broker-id"] == name
        ids.add(flags["--broker-id"])
        # It binds to (and so advertises) its own service name, reachable by every container.
        host, _, port = flags["--http"].rpartition(":")
        assert host == name and _services()[name]["hostname"] == name
        assert flags["--worker-listen"].startswith(f"{name}:")
        urls.add(_broker_url(name))
        # Its data dir is a named volume of its own.
        mounts = [str(v).split(":") for v in _services()[name]["volumes"]]
        data = [source for source, target, *_ in mounts if target == flags["--data-dir"]]
        assert len(data) == 1, f"{name}: --data-dir must be a volume"
        volumes.add(data[0])
        # Published on the same port number it serves on, so its advertised URL works outside.
        assert _published_ports()[name] == [int(port)]
    assert len(ids) == len(volumes) == len(urls) == len(BROKERS)
    assert volumes <= set(_compose()["volumes"])


def test_workers_point_at_every_broker_and_the_spark_master() -> None:
    master = _flags(_command("spark-master"))
    spark_url = f"spark://{master['--host']}:{master['--port']}"
    broker_urls = {_broker_url(name) for name in BROKERS}
    ids = set()
    for name in WORKERS:
        command = _command(name)
        flags = _flags(command)
        assert command[0] == "worker"
        assert set(flags["--brokers"].split(",")) == broker_urls, name
        assert flags["--spark-master"] == spark_url, name
        ids.add(flags["--worker-id"])
        # Executors connect back to this worker's driver by its service name.
        assert f"--spark-conf=spark.driver.host={name}" in command, name
    assert ids == set(WORKERS)
    # The Spark worker registers with that master.
    assert spark_url in _command("spark-worker")


def test_every_long_running_service_has_a_healthcheck() -> None:
    for name, service in _services().items():
        if name in ONE_SHOT:
            assert service.get("restart") == "no", name
            continue
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"


def test_start_order_waits_for_health_and_for_the_retention_policy() -> None:
    services = _services()
    for name in BROKERS:
        depends = services[name]["depends_on"]
        assert depends["zookeeper"]["condition"] == "service_healthy"
        assert depends["pulsar"]["condition"] == "service_healthy"
        assert depends["pulsar-init"]["condition"] == "service_completed_successfully"
    for name in WORKERS:
        depends = services[name]["depends_on"]
        for dependency in (*BROKERS, "spark-worker"):
            assert depends[dependency]["condition"] == "service_healthy", (name, dependency)
    init = " ".join(_command("pulsar-init"))
    assert "set-retention public/steward --size -1 --time -1" in init
    assert "--disable-delete-while-inactive" in init


def test_volumes_are_declared_and_servers_need_nothing_outside_compose() -> None:
    declared = set(_compose()["volumes"])
    for name, service in _services().items():
        for spec in service.get("volumes", []):
            source = str(spec).split(":")[0]
            assert source in declared, f"{name}: {source} is not a named volume"
        # No host networking and no bind mounts of host paths.
        assert "network_mode" not in service, name


def test_spark_versions_match() -> None:
    """The Steward image's pyspark (the drivers) is the Spark master's version."""
    services = _services()
    compose_version = _default(services["broker-1"]["build"]["args"]["PYSPARK_VERSION"])
    assert _default(services["spark-master"]["image"]) == compose_version
    match = re.search(r"^ARG PYSPARK_VERSION=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match and match.group(1) == compose_version


def test_pulsar_image_is_the_version_the_suite_tests() -> None:
    """Both Pulsar services run the version tests/engines/pom.xml pins (its one definition),
    the one the real-Pulsar tests start from Maven Central's jars."""
    services = _services()
    images = {services[name]["image"] for name in ("pulsar", "pulsar-init")}
    assert images == {f"apachepulsar/pulsar:{pulsar_version()}"}, images


def test_worker_commands_parse_with_the_real_cli() -> None:
    parser = cli.build_parser()
    for name in WORKERS:
        command = _command(name)
        assert parser.parse_args(command).command == "worker"
        args = build_worker_parser().parse_args(command[1:])
        assert args.worker_id == name
        assert args.brokers == [_broker_url(broker) for broker in BROKERS]


def test_broker_commands_parse_with_the_real_cli() -> None:
    parser = cli.build_parser()
    for name in BROKERS:
        args = parser.parse_args(_command(name))
        assert args.broker_id == name
        assert args.http == (name, _published_ports()[name][0])


@pytest.mark.timeout(180)
def test_compose_file_validates_with_docker_compose() -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed (./scripts/test installs it)")
    result = subprocess.run(
        [exe, "-f", str(COMPOSE), "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- docs/OPERATIONS.md ------------------------------------------------------------------------


def _readme_section(title: str) -> str:
    text = OPERATIONS.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_production_layout_is_one_section_naming_each_piece_s_test() -> None:
    text = OPERATIONS.read_text()
    assert text.startswith("# Operations\n\n## Production layout\n")
    section = _readme_section("Production layout")
    for test in (
        "tests/integration/test_zk_ensemble.py",
        "tests/integration/test_ledger_pulsar.py",
        "tests/integration/test_spark_standalone.py",
        "tests/integration/test_spark_remote.py",
        "tests/jepsen",
        "tests/chaos",
        "bench/bench_workers_scale.py",
    ):
        assert f"`{test}" in section, f"the production layout does not name {test}"
        assert (ROOT / test).exists(), test
    assert "### Not tested here" in section


def test_readme_names_every_service_and_published_port() -> None:
    section = _readme_section("Production layout")
    for name in SERVICES:
        assert re.search(rf"`{re.escape(name)}`", section), f"OPERATIONS.md does not name {name}"
    for name, ports in _published_ports().items():
        for port in ports:
            assert re.search(rf"\b{port}\b", section), f"OPERATIONS.md lacks {name}'s port {port}"
    for needed in (
        "docker compose up",
        "set-retention public/steward --size -1 --time -1",
        "--disable-delete-while-inactive",
        "--ledgers pulsar",
        "--pulsar-token",
        "--spark-master",
    ):
        assert needed in section, f"docs/OPERATIONS.md does not give {needed!r}"


def _shell_block_after(text: str, marker: str) -> list[str]:
    """The command lines of the first ```sh block after ``marker`` (its comments, such as
    the excerpt marker tests/integration/test_docs_run.py reads, left out)."""
    start = text.index(marker)
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block is not None, f"no ```sh block after {marker!r} in README.md"
    return [
        line
        for line in block.group(1).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_readme_test_command_is_all_that_ci_runs() -> None:
    # A newcomer runs the README's lines verbatim on a fresh machine (issues 17 and 30): CI
    # runs the very same line and nothing else, so a green CI proves the README's set-up.
    readme = (ROOT / "README.md").read_text()
    demo_command = _shell_block_after(readme, "## The two commands")
    test_command = _shell_block_after(readme, "The tests (")
    assert demo_command == ["./scripts/demo"], demo_command
    assert test_command == ["./scripts/test"], test_command
    ci_lines = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ci_lines == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', test_command[0]], ci_lines


def test_the_setup_scripts_install_what_the_tests_name() -> None:
    # Each system package the suite uses is installed by the README's test line, not by
    # hand or by .ci/run alone (issue 30: a verbatim run on a fresh machine failed).
    script = (ROOT / "scripts" / "test").read_text()
    for needed in (
        "docker-compose:docker-compose",
        "chromium:chromium",
        "chromium-driver:chromedriver",
        "prometheus:promtool",
        "libnss-wrapper",
        "nftables:nft",
        "jq:jq",
        "curl:curl",
        "maven:mvn",
        "axe-core@",
        "steward_setup_venv test",
        "steward_setup_traversal",
        "steward_setup_engines",
        'exec .venv/bin/pytest "$@"',
    ):
        assert needed in script, f"scripts/test does not set up {needed!r}"
    for name in ("setup", "demo", "test", "fetch-engines"):
        result = subprocess.run(
            ["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True, text=True
        )
        assert result.returncode == 0, f"scripts/{name}: {result.stderr}"
