"""``python -m clients.worker``: run one worker until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from broker.security.auth import secret_from_options
from broker.security.tls import CA_ENV
from clients.worker.config import (
    DEFAULT_MAX_CACHE_BYTES,
    PARENT_PID_ENV,
    WorkerConfig,
    default_cache_dir,
    default_resources,
    default_task_types,
    default_work_dir,
    default_worker_id,
    parse_broker_option,
    parse_http_urls,
)
from clients.worker.link.worker_link import LinkMisconfiguredError, run_worker
from clients.worker.sandbox import make_non_dumpable, set_parent_death_signal
from clients.worker.spark.connect_server import SPARK_MODES, spark_identity
from clients.worker.spark.tenant_servers import tenant_servers_wanted
from clients.worker.spark_remote_url import TOKEN_ENV as REMOTE_TOKEN_ENV
from clients.worker.spark_remote_url import with_token
from clients.worker.task_env import (
    TaskProcessError,
    WorkDirInUseError,
    lock_work_dir,
    remove_work_dir,
)
from clients.worker.task_identity import DEFAULT_TASK_UID_RANGE
from clients.worker.task_processes.pool import check_task_processes, disable_grpc_fork_handlers


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _broker(text: str) -> tuple[str, list[str]]:
    try:
        return parse_broker_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _uid_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    if not sep or not low.isdigit() or not high.isdigit() or not 0 < int(low) <= int(high):
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH with 0 < LOW <= HIGH, got {text!r}")
    return int(low), int(high)


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and 86400, got {text!r}")
    return value


def _brokers(text: str) -> list[str]:
    try:
        return parse_http_urls(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_DEFAULT_HTTP_URL = "http://127.0.0.1:8080"


def _default_broker() -> tuple[str, list[str]]:
    """--broker's default: STEWARD_BROKER, else the CLI's STEWARD_URL, else the local broker's
    HTTP URL (ValueError naming the variable when it holds neither a URL nor HOST:PORT)."""
    for name in ("STEWARD_BROKER", "STEWARD_URL"):
        text = os.environ.get(name, "").strip()
        if text:
            try:
                return parse_broker_option(text)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    return parse_broker_option(_DEFAULT_HTTP_URL)


TOKEN_ENV = "STEWARD_WORKER_TOKEN"
TOKEN_FILE_ENV = "STEWARD_WORKER_TOKEN_FILE"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steward worker", description="a Steward worker")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--broker",
        type=_broker,
        default=None,
        metavar="URL[,URL...]",
        help="the broker's HTTP URL, or those of any brokers of a cluster (comma-separated): "
        "before each connection the worker asks them for the leader's worker endpoint and "
        "connects there, following leader changes; or HOST:PORT of a worker endpoint to "
        "connect to directly (env STEWARD_BROKER, else STEWARD_URL; default: "
        f"{_DEFAULT_HTTP_URL})",
    )
    where.add_argument(
        "--brokers",
        type=_brokers,
        default=None,
        metavar="URL[,URL...]",
        help="the same as --broker URL[,URL...] (kept for old command lines)",
    )
    p.add_argument(
        "--http-url",
        default=None,
        help="broker HTTP base URL for code downloads (env STEWARD_URL; default: the "
        f"leader found from broker URLs, else {_DEFAULT_HTTP_URL})",
    )
    p.add_argument("--worker-id", help="stable worker name (default: HOSTNAME-PID)")
    p.add_argument(
        "--task-type",
        type=_pair,
        action="append",
        default=[],
        metavar="TYPE=N",
        help="concurrent tasks of TYPE ('*' = any type; default: *=cores); repeatable",
    )
    p.add_argument(
        "--resource",
        type=_pair,
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="resource offered (default: cpu=cores, memory_mb=MemTotal); repeatable",
    )
    p.add_argument("--tenant", action="append", default=[], help="serve only these; repeatable")
    spark = p.add_argument_group("Spark (docs/SECURITY.md, 'Spark')")
    spark.add_argument(
        "--spark",
        choices=SPARK_MODES,
        default="connect",
        help="'connect': a Spark Connect server per tenant (a root worker: under the tenant's"
        " task uid, started on first use; otherwise one per worker) and a session per task"
        " attempt as ctx.spark (default); 'classic': a SparkSession (a JVM) in each task"
        " process; 'off': no Spark",
    )
    spark.add_argument("--spark-master", default="local[*]")
    spark.add_argument("--spark-conf", type=_pair, action="append", default=[], metavar="KEY=VALUE")
    spark.add_argument(
        "--spark-user",
        metavar="USER",
        help="run ONE Spark Connect server (and its Python UDFs) for every tenant as USER;"
        " default as root: a server per tenant under the tenant's own task uid (its Spark"
        " files are its own); otherwise the worker's own user",
    )
    spark.add_argument(
        "--spark-max-servers",
        type=int,
        default=4,
        metavar="N",
        help="a root worker's per-tenant Spark Connect servers at most (the least recently"
        " used idle one makes room; default 4)",
    )
    spark.add_argument(
        "--spark-server-idle-s",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="stop a tenant's Spark Connect server idle this long (default 300)",
    )
    spark.add_argument(
        "--spark-driver-memory-mb",
        type=int,
        default=1024,
        metavar="MB",
        help="each Spark Connect server's JVM heap (spark.driver.memory; default 1024)",
    )
    spark.add_argument(
        "--spark-remote",
        metavar="sc://HOST:PORT",
        help="make each PySpark task's ctx.spark a session of its own on this Spark Connect"
        " server instead of the worker's own (docs/SECURITY.md, 'Remote Spark Connect');"
        " ';token=...' in the URL is readable by every local user: prefer"
        f" --spark-remote-token-file or {REMOTE_TOKEN_ENV}",
    )
    spark.add_argument(
        "--spark-remote-token-file",
        metavar="PATH",
        help="the --spark-remote server's token, first line of this file (env"
        f" {REMOTE_TOKEN_ENV}_FILE, or the token itself in {REMOTE_TOKEN_ENV}, removed from"
        " the environment once read)",
    )
    spark.add_argument(
        "--allow-classic-spark",
        action="store_true",
        help="with --spark connect: let tasks use ctx.classic_spark (RDDs, sparkContext): a"
        " JVM in the tenant's task process, seconds to start",
    )
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument(
        "--cache-max-mb",
        type=float,
        default=DEFAULT_MAX_CACHE_BYTES / (1024 * 1024),
        metavar="MB",
        help="past this the artifact cache evicts its least recently used artifacts "
        "(0: unbounded; deleted artifacts are dropped anyway)",
    )
    p.add_argument("--max-result-bytes", type=int, default=1024 * 1024)
    p.add_argument(
        "--token-file",
        "--worker-token-file",
        dest="token_file",
        type=Path,
        default=os.environ.get(TOKEN_FILE_ENV),
        metavar="PATH",
        help=f"the worker credential (steward token create NAME --worker) or the shared "
        f"worker token, first line of this file (env {TOKEN_FILE_ENV}; or the secret itself "
        f"in {TOKEN_ENV}, which the worker removes from its environment)",
    )
    p.add_argument(
        "--token",
        default=None,
        help=f"deprecated: the secret on the command line, readable by every local user; "
        f"use --token-file or {TOKEN_ENV}",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="connect to the worker endpoint with TLS (with --brokers this follows the "
        "leader's announcement by itself)",
    )
    p.add_argument(
        "--tls-ca",
        type=Path,
        default=os.environ.get(CA_ENV),
        metavar="PATH",
        help=f"CA bundle to verify brokers with (https:// URLs, TLS worker endpoint; env "
        f"{CA_ENV}; default: the system trust store)",
    )
    isolation = p.add_argument_group("task isolation (docs/SECURITY.md)")
    isolation.add_argument(
        "--task-isolation",
        choices=("process", "thread"),
        default="process",
        help="'process': tenant code runs in task processes, one tenant each, under task"
        " users (default); 'thread': in the worker process (trusted tenants only)",
    )
    isolation.add_argument(
        "--task-user",
        metavar="USER",
        help="run every tenant's task processes as USER (default as root: a uid of its own"
        " per tenant from --task-uid-range; otherwise the worker's own user)",
    )
    isolation.add_argument(
        "--tenant-user",
        type=_pair,
        action="append",
        default=[],
        metavar="TENANT=USER",
        help="run TENANT's task processes as USER; repeatable",
    )
    isolation.add_argument(
        "--task-uid-range",
        type=_uid_range,
        default=DEFAULT_TASK_UID_RANGE,
        metavar="LOW-HIGH",
        help="uids given to tenants when the worker runs as root (default: %(default)s);"
        " give each worker on a host its own range",
    )
    isolation.add_argument(
        "--allow-root-tasks",
        action="store_true",
        help="allow --task-user root: tenant code then runs as root (unsafe, logged loudly)",
    )
    isolation.add_argument(
        "--task-memory-mb",
        type=int,
        default=0,
        help="address-space limit of a task process unless the task asks for"
        " resources.memory_mb (default: 0, none)",
    )
    isolation.add_argument(
        "--work-dir",
        type=Path,
        default=default_work_dir(),
        help="task processes' working directories, homes and code copies (default:"
        " %(default)s-<worker id>, one per worker, with its broker's pid when a standalone"
        " broker started it; removed when the worker stops cleanly;"
        " a directory given here is kept; one worker at a time: a second one exits with"
        " status 2; task users must be able to reach it)",
    )
    isolation.add_argument(
        "--task-process-idle-s",
        type=float,
        default=60.0,
        help="end a task process idle this long (default: %(default)s)",
    )
    isolation.add_argument(
        "--task-process-max-tasks",
        type=int,
        default=1000,
        help="start a fresh process after this many tasks (default: %(default)s)",
    )
    isolation.add_argument(
        "--task-process-max-rss-mb",
        type=float,
        default=0.0,
        help="start a fresh process once one's resident memory passes this (default: 0, off)",
    )
    p.add_argument(
        "--stop-grace-s",
        type=_grace,
        default=WorkerConfig.stop_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM/Ctrl-C, let running tasks finish this long, then give the rest"
        " back to the broker for another worker (not counted as failed; 0: at once;"
        " default: %(default)s)",
    )
    p.add_argument("--log-level", default="INFO")
    from broker.observability.logs import add_log_format_option

    add_log_format_option(p)
    return p


def _say(message: str) -> None:
    print(f"steward worker: {message}", file=sys.stderr, flush=True)


def _warn(message: str) -> None:
    print(f"steward worker: warning: {message}", file=sys.stderr, flush=True)


def worker_token(args: argparse.Namespace) -> str | None:
    """The token from --token-file, --token (deprecated: warns) or STEWARD_WORKER_TOKEN,
    which is removed from the environment so no child process inherits it."""
    return secret_from_options(
        argv_value=args.token,
        argv_flag="--token",
        file=args.token_file,
        file_flag="--token-file",
        env=TOKEN_ENV,
        warn=_warn,
    )


def spark_remote_url(args: argparse.Namespace) -> str | None:
    """--spark-remote with the token from --spark-remote-token-file or the environment."""
    env_file = os.environ.pop(f"{REMOTE_TOKEN_ENV}_FILE", None)  # no child inherits it
    token = secret_from_options(
        argv_value=None,
        argv_flag="--spark-remote",
        file=args.spark_remote_token_file or env_file,
        file_flag="--spark-remote-token-file",
        env=REMOTE_TOKEN_ENV,
        warn=_warn,
    )
    if args.spark_remote is None:
        if token is not None:
            raise ValueError(f"a Spark Connect token ({REMOTE_TOKEN_ENV}) without --spark-remote")
        return None
    if ";token=" in args.spark_remote:
        _warn(
            "--spark-remote with ;token= on the command line: every local user can read it"
            f" (ps, /proc/PID/cmdline); use --spark-remote-token-file or {REMOTE_TOKEN_ENV}"
        )
    return with_token(args.spark_remote, token)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    endpoint, urls = ("", []) if args.brokers else args.broker or _default_broker()
    brokers: list[str] = args.brokers or urls
    http_url: str | None = args.http_url
    # Given broker URLs and no --http-url: download from whichever broker leads.
    download_from_leader = bool(brokers) and http_url is None
    if http_url is None:
        env_url = os.environ.get("STEWARD_URL", "").split(",")[0].strip()
        http_url = brokers[0] if brokers else env_url or _DEFAULT_HTTP_URL
    return WorkerConfig(
        broker=endpoint,
        http_url=http_url,
        brokers=brokers,
        download_from_leader=download_from_leader,
        worker_id=args.worker_id or default_worker_id(),
        task_types={n: int(c) for n, c in args.task_type} or default_task_types(),
        resources={n: float(a) for n, a in args.resource} or default_resources(),
        tenants=list(args.tenant),
        spark=args.spark,
        spark_user=args.spark_user,
        allow_classic_spark=args.allow_classic_spark,
        spark_master=args.spark_master,
        spark_conf=dict(args.spark_conf),
        spark_remote=spark_remote_url(args),
        spark_max_servers=args.spark_max_servers,
        spark_server_idle_s=args.spark_server_idle_s,
        spark_driver_memory_mb=args.spark_driver_memory_mb,
        cache_dir=args.cache_dir,
        max_cache_bytes=int(args.cache_max_mb * 1024 * 1024),
        max_result_bytes=args.max_result_bytes,
        token=worker_token(args),
        tls=args.tls,
        tls_ca=args.tls_ca,
        task_isolation=args.task_isolation,
        task_user=args.task_user,
        tenant_users=dict(args.tenant_user),
        task_uid_range=args.task_uid_range,
        allow_root_tasks=args.allow_root_tasks,
        task_memory_mb=args.task_memory_mb,
        work_dir=args.work_dir,
        task_process_idle_s=args.task_process_idle_s,
        task_process_max_tasks=args.task_process_max_tasks,
        task_process_max_rss_mb=args.task_process_max_rss_mb,
        stop_timeout_s=args.stop_grace_s,
    )


#: Set by a standalone broker for the workers it starts: its pid (see main).


def main(argv: Sequence[str] | None = None) -> int:
    disable_grpc_fork_handlers()  # first: before anything imports grpc (task_processes/pool.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    parent_pid = os.environ.pop(PARENT_PID_ENV, "")
    if parent_pid.isdigit() and config.work_dir_is_default:
        # Every standalone broker names its workers <broker id>-worker-N: its pid keeps the
        # work dirs of two standalone brokers on one host (the demo beside another) apart.
        config.work_dir = default_work_dir(f"{config.worker_id}-{parent_pid}")
    # A standalone broker restarted after a kill -9 starts a worker of the same id (and
    # work dir) while the previous one may still be giving its tasks back: wait for it.
    wait_s = config.stop_timeout_s + 10.0 if parent_pid.isdigit() else 0.0
    try:
        lock = lock_work_dir(
            config.work_dir,
            wait_s,
            lambda in_use: _say(f"{in_use}; waiting up to {wait_s:.0f} s for it to stop"),
        )
    except WorkDirInUseError as exc:
        print(f"steward worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (TaskProcessError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(
            f"steward worker: error: cannot use --work-dir {config.work_dir}: {reason}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    crashed = False
    try:
        return _run(parser, args, config, parent_pid)
    except Exception:
        crashed = True  # its directory may tell why: kept
        raise
    finally:
        # A default work dir is this worker's alone (its id in the name): on a clean exit
        # nothing in it is needed again, and a worker per pid would fill /tmp.
        if not crashed and config.work_dir_is_default and not remove_work_dir(config.work_dir):
            _warn(f"could not remove all of the work dir {config.work_dir}")
        os.close(lock)


def _run(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    config: WorkerConfig,
    parent_pid: str,
) -> int:
    try:
        if config.task_isolation == "process":
            for warning in check_task_processes(config):
                _warn(warning)
            shared_spark = config.spark == "connect" and config.spark_remote is None
            if shared_spark and not tenant_servers_wanted(config):
                spark_identity(config)  # a usable --spark-user, or a uid of its own
    except ValueError as exc:
        parser.error(str(exc))
    # Task processes under the worker's own uid must not read its memory or environment.
    make_non_dumpable()
    if parent_pid.isdigit():
        # Started by a standalone broker (--workers N): it runs in a session of its own (a
        # terminal's Ctrl-C reaches the broker alone), so nothing would stop it if the
        # broker died without its SIGTERM (kill -9): Linux sends it one instead.
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != int(parent_pid):
            print("steward worker: the broker that started it is gone", file=sys.stderr)
            return 0
    from broker.observability.logs import setup_logging

    # Task-related lines carry task_id and tenant (text: "task=12 tenant=acme").
    setup_logging(args.log_level, args.log_format, static_fields={"worker": config.worker_id})
    # Not a line per leader lookup or download: the worker logs what it found or failed.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    try:
        run_worker(config)
    except LinkMisconfiguredError as exc:
        # Retrying cannot heal it: one line saying what to pass instead, and a failure exit.
        print(f"steward worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
