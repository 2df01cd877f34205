"""The Spark Connect pieces that need no JVM: who runs the server, what a Run tells a task
process, the listener check before the token is sent, the worker's flags."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from clients.worker.__main__ import build_parser, config_from_args
from clients.worker.config import WorkerConfig, default_work_dir
from clients.worker.link.worker_link import Worker
from clients.worker.spark.connect_server import (
    TOKEN_ENV,
    ConnectEndpoint,
    SparkConnectError,
    listener_uid,
    rotate_log,
    server_command,
    spark_identity,
    tenant_uid_range,
    wait_listening,
)
from clients.worker.task_api import TaskContext
from clients.worker.task_identity import TaskUserError
from clients.worker.task_processes.child import spark_access
from clients.worker.task_processes.pipe_protocol import Run
from clients.worker.task_processes.pool import task_identities
from wire.worker_protocol import AssignedTask


def config(**overrides: Any) -> WorkerConfig:
    return WorkerConfig(broker="127.0.0.1:1", http_url="http://127.0.0.1:1", **overrides)


def test_a_root_worker_runs_the_server_under_the_last_task_uid_no_tenant_gets() -> None:
    cfg = config(task_uid_range=(61184, 61186))
    identity = spark_identity(cfg, worker_uid=0)
    assert (identity.uid, identity.switch) == (61186, True)
    assert tenant_uid_range(cfg, worker_uid=0) == (61184, 61185)
    assert tenant_uid_range(config(spark="off", task_uid_range=(1, 5)), worker_uid=0) == (1, 5)
    assert tenant_uid_range(cfg, worker_uid=1000) == (61184, 61186)


def test_the_spark_uid_is_never_given_to_a_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)
    identities = task_identities(config(task_uid_range=(61184, 61185)))
    assert identities.for_tenant("a").uid == 61184
    with pytest.raises(TaskUserError, match="used up"):
        identities.for_tenant("b")


def test_the_server_never_runs_as_root() -> None:
    with pytest.raises(TaskUserError, match="root"):
        spark_identity(config(spark_user="root"), worker_uid=0)
    with pytest.raises(TaskUserError, match="--spark-user"):
        spark_identity(config(task_uid_range=(7, 7)), worker_uid=0)
    not_root = spark_identity(config(), worker_uid=1000)
    assert (not_root.uid, not_root.switch) == (1000, False)


def test_the_token_is_never_on_the_servers_command_line() -> None:
    command = server_command("/spark", "local[2]", 4242, Path("/w/p.properties"), 1)
    text = " ".join(command)
    assert "token" not in text.lower() and TOKEN_ENV not in text
    assert "spark.connect.grpc.binding.address=127.0.0.1" in command


def test_listener_uid_reads_ipv4_and_ipv6_tables(tmp_path: Path) -> None:
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    tcp = tmp_path / "tcp"
    tcp.write_text(
        header
        + "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1234 0 1\n"
    )
    tcp6 = tmp_path / "tcp6"
    tcp6.write_text(
        header + "   1: 0000000000000000FFFF00000100007F:B94F 00000000000000000000000000000000:0000"
        " 0A 00000000:00000000 00:00000000 00000000 65519 0 2\n"
    )
    tables = (str(tcp), str(tcp6))
    assert listener_uid(0x1F90, tables) == 1234
    assert listener_uid(0xB94F, tables) == 65519
    assert listener_uid(80, tables) is None


def test_a_task_refuses_a_port_another_uid_listens_on() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        endpoint = ConnectEndpoint(port, "t", uid=65519)  # not this process's uid
        with pytest.raises(SparkConnectError, match="not sending it the token"):
            wait_listening(endpoint, 5.0)


def test_a_task_waits_boundedly_for_a_server_that_never_comes() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(SparkConnectError, match="did not start within"):
        wait_listening(ConnectEndpoint(port, "t", uid=65519), 0.3)


def _run(**fields: Any) -> Run:
    return Run(
        task_id=1,
        attempt=1,
        tenant="a",
        type="noop",
        params=b"",
        workdir="/",
        max_result_bytes=10,
        **fields,
    )


def _ctx(run: Run) -> TaskContext:
    task = AssignedTask(task_id=1, attempt=1, type="noop", tenant="a", params=b"")
    return TaskContext(task, spark_factory=lambda: pytest.fail("no JVM here"), **spark_access(run))


def test_classic_spark_without_the_flag_names_the_flag() -> None:
    ctx = _ctx(_run(spark_mode="connect", allow_classic_spark=False, spark_error="down"))
    with pytest.raises(RuntimeError, match="--allow-classic-spark"):
        ctx.classic_spark  # noqa: B018
    with pytest.raises(RuntimeError, match="Spark is not available: down"):
        ctx.spark  # noqa: B018


def test_spark_off_says_so() -> None:
    ctx = _ctx(_run(spark_mode="off"))
    for name in ("spark", "classic_spark"):
        with pytest.raises(RuntimeError, match="--spark off"):
            getattr(ctx, name)


def test_connect_mode_gives_a_session_factory_and_classic_mode_none() -> None:
    connect = spark_access(
        _run(spark_mode="connect", spark_connect_port=1, allow_classic_spark=True)
    )
    assert callable(connect["connect_factory"]) and connect["classic_unavailable"] is None
    assert spark_access(_run(spark_mode="classic")) == {"classic_unavailable": None}


def test_worker_flags() -> None:
    args = build_parser().parse_args(["--spark", "classic", "--spark-user", "nobody"])
    cfg = config_from_args(args)
    assert (cfg.spark, cfg.spark_user, cfg.allow_classic_spark) == ("classic", "nobody", False)
    assert config_from_args(build_parser().parse_args([])).spark == "connect"
    assert config_from_args(
        build_parser().parse_args(["--allow-classic-spark"])
    ).allow_classic_spark
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--spark", "sometimes"])
    with pytest.raises(ValueError, match="spark must be"):
        config(spark="sometimes")


def test_only_a_worker_whose_tasks_can_reach_spark_starts_a_server() -> None:
    def has_server(types: dict[str, int]) -> bool:
        config = WorkerConfig(broker="127.0.0.1:1", http_url="http://127.0.0.1:1", task_types=types)
        worker = Worker(config)  # run() would start the server; this only builds it
        worker.runtime.shutdown()
        return worker.spark_server is not None

    for types in ({"noop": 8}, {"sleep": 1, "fail": 1}):
        assert not has_server(types), types  # no JVM for these
    for types in ({"*": 4}, {"spark.sql": 1}, {"noop": 1, "jobs:run": 2}):
        assert has_server(types), types


def test_each_worker_gets_a_work_dir_of_its_own_by_default(tmp_path: Path) -> None:
    # Two workers on a host shared /tmp/steward-worker-<uid> (Spark server, its log, code).
    one, two = config(worker_id="w-1"), config(worker_id="host/w 2")
    assert one.work_dir == default_work_dir("w-1") != two.work_dir
    assert one.work_dir.name == f"steward-worker-{os.geteuid()}-w-1"
    assert two.work_dir.name == f"steward-worker-{os.geteuid()}-host_w_2"  # one path part
    assert config(worker_id="w-1", work_dir=tmp_path).work_dir == tmp_path  # as given
    parsed = config_from_args(build_parser().parse_args(["--worker-id", "w-3"]))
    assert parsed.work_dir == default_work_dir("w-3")


def test_the_server_log_is_rotated_past_its_cap(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    rotate_log(log, 10)  # none yet: nothing to do
    log.write_bytes(b"x" * 10)
    rotate_log(log, 10)
    assert log.read_bytes() == b"x" * 10  # at the cap: kept
    log.write_bytes(b"y" * 11)
    rotate_log(log, 10)
    assert not log.exists() and (tmp_path / "server.log.1").read_bytes() == b"y" * 11
