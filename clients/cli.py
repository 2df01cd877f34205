"""The ``steward`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from broker.security.tls import CA_ENV, TlsConfig, TlsConfigError
from clients.client import (
    CertificateVerifyError,
    StewardClient,
    StewardError,
    TaskHandle,
    TaskTimeoutError,
    parse_urls,
)
from clients.progress import print_progress

if TYPE_CHECKING:
    from broker.api.edges import HttpEdgeConfig
    from broker.security.auth import AuthConfig
    from log.pulsar import PulsarConfig

DEFAULT_URL = "http://127.0.0.1:8080"
# Shorter than the library's 30 s: someone is waiting at the terminal.
DEFAULT_FAILOVER_TIMEOUT_S = 10.0


class UsageError(Exception):
    pass


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _broker_urls(text: str) -> list[str]:
    try:
        return parse_urls(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def _tenant_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected TENANT[,TENANT...], got {text!r}")
    return names


def _resource(text: str) -> tuple[str, float]:
    name, sep, amount = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT, got {text!r}") from None


def _add_broker_options(p: argparse.ArgumentParser) -> None:
    """Options every kind of broker takes (standalone and cluster)."""
    p.add_argument(
        "--worker-token-file",
        type=Path,
        default=os.environ.get("STEWARD_WORKER_TOKEN_FILE"),
        metavar="PATH",
        help="the workers' shared token (legacy, unscoped; prefer worker credentials: "
        "steward token create NAME --worker), first line of this file (env "
        "STEWARD_WORKER_TOKEN_FILE, or the token itself in STEWARD_WORKER_TOKEN)",
    )
    p.add_argument(
        "--worker-token",
        default=None,
        help="deprecated (readable by every local user): use --worker-token-file or "
        "STEWARD_WORKER_TOKEN",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=os.environ.get("STEWARD_ADMIN_TOKEN_FILE"),
        metavar="PATH",
        help="turn authentication on: every API call needs a token, and the token in this "
        "file is an admin one (env STEWARD_ADMIN_TOKEN_FILE, or the token itself in "
        "STEWARD_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--cluster-token-file",
        type=Path,
        default=os.environ.get("STEWARD_CLUSTER_TOKEN_FILE"),
        metavar="PATH",
        help="the brokers' shared secret for snapshot and code downloads between them, "
        "first line of this file (env STEWARD_CLUSTER_TOKEN_FILE, or the secret itself in "
        "STEWARD_CLUSTER_TOKEN)",
    )
    p.add_argument(
        "--cluster-token",
        default=None,
        help="deprecated (readable by every local user): use --cluster-token-file or "
        "STEWARD_CLUSTER_TOKEN",
    )
    p.add_argument("--heartbeat-interval-ms", type=int, default=1000)
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=10_000,
        help="a worker silent or disconnected this long is declared dead (default %(default)s)",
    )
    p.add_argument("--snapshot-interval-s", type=float, default=60.0)
    p.add_argument("--ledger-roll-mb", type=float, default=64.0)
    _add_edge_options(p)
    _add_log_format_option(p)
    p.add_argument("--log-level", default="INFO")
    _add_tls_options(p, "", "to verify other brokers with, passed on to child workers")


def _add_edge_options(p: argparse.ArgumentParser) -> None:
    """Bounds on what a client or a would-be worker may make the broker hold or wait for."""
    p.add_argument(
        "--http-header-timeout-s",
        type=float,
        default=10.0,
        metavar="S",
        help="a request's line and headers must arrive within this (408 after; "
        "default %(default)s)",
    )
    p.add_argument(
        "--http-body-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="a request body must arrive within this, plus 1 s per 64 KiB received "
        "(408 after; default %(default)s)",
    )
    p.add_argument(
        "--http-max-connections",
        type=int,
        default=1024,
        metavar="N",
        help="HTTP connections served at once; more are answered 503 (default %(default)s)",
    )
    p.add_argument(
        "--worker-hello-timeout-s",
        type=float,
        default=5.0,
        metavar="S",
        help="a connection to the worker port must send its hello within this "
        "(default %(default)s)",
    )
    p.add_argument(
        "--worker-max-unauthenticated",
        type=int,
        default=64,
        metavar="N",
        help="worker-port connections before their hello is accepted; more are refused "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-task-output-mb",
        type=float,
        default=256.0,
        metavar="MB",
        help="task output (steward logs) the leader keeps in memory in total, the oldest "
        "attempt's evicted first; each attempt keeps its last 1 MiB (default %(default)s)",
    )


def _http_edges(args: argparse.Namespace) -> HttpEdgeConfig:
    from broker.api.edges import HttpEdgeConfig

    edges = HttpEdgeConfig(
        header_timeout_s=args.http_header_timeout_s,
        body_timeout_s=args.http_body_timeout_s,
        max_connections=args.http_max_connections,
    )
    problem = edges.problem()
    if problem is not None:
        raise UsageError(f"--http-*: {problem}")
    if not args.worker_hello_timeout_s > 0 or args.worker_max_unauthenticated < 1:
        raise UsageError("need --worker-hello-timeout-s > 0 and --worker-max-unauthenticated >= 1")
    if not args.max_task_output_mb >= 0:
        raise UsageError("--max-task-output-mb must be >= 0")
    return edges


def _add_tls_options(p: argparse.ArgumentParser, scope: str, ca_use: str) -> None:
    """--tls-cert/--tls-key/--tls-ca of a broker (``scope`` prefixes the help texts)."""
    p.add_argument(
        "--tls-cert",
        type=Path,
        metavar="PATH",
        help=f"{scope}PEM certificate (chain): serve HTTPS and TLS to workers (needs --tls-key)",
    )
    p.add_argument(
        "--tls-key", type=Path, metavar="PATH", help=f"{scope}PEM private key of --tls-cert"
    )
    p.add_argument(
        "--tls-ca",
        type=Path,
        default=os.environ.get(CA_ENV),
        metavar="PATH",
        help=f"{scope}CA bundle {ca_use} (env {CA_ENV}; default: the system trust store)",
    )


def _tls_config(args: argparse.Namespace) -> TlsConfig | None:
    try:
        return TlsConfig.from_options(args.tls_cert, args.tls_key, args.tls_ca)
    except TlsConfigError as exc:
        raise UsageError(str(exc)) from None


def _add_log_format_option(p: argparse.ArgumentParser) -> None:
    from broker.observability.logs import add_log_format_option

    add_log_format_option(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steward", description="Steward: a highly available resource manager for tasks"
    )
    parser.add_argument(
        "--url",
        type=_broker_urls,
        default=os.environ.get("STEWARD_URL", DEFAULT_URL),
        metavar="URL[,URL...]",
        help="broker URL(s) for client commands; writes find the leader among them "
        "(env STEWARD_URL; default %(default)s)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("STEWARD_TOKEN"),
        help="API token for client commands (env STEWARD_TOKEN)",
    )
    parser.add_argument(
        "--failover-timeout-s",
        type=_positive_seconds,
        default=os.environ.get("STEWARD_FAILOVER_TIMEOUT_S", str(DEFAULT_FAILOVER_TIMEOUT_S)),
        metavar="S",
        help="how long a write keeps trying other brokers or waits for a leader "
        "(env STEWARD_FAILOVER_TIMEOUT_S; default %(default)s)",
    )
    parser.add_argument(
        "--ca-file",
        type=Path,
        default=os.environ.get(CA_ENV),
        metavar="PATH",
        help=f"CA bundle to verify https:// brokers with (env {CA_ENV}; default: the "
        "system trust store)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("standalone", help="run one standalone broker (no ZooKeeper)")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="default: ./data")
    p.add_argument("--http", type=_host_port, default=("127.0.0.1", 8080), metavar="HOST:PORT")
    p.add_argument(
        "--worker-listen",
        type=_host_port,
        default=("127.0.0.1", 7070),
        metavar="HOST:PORT",
        help="where workers connect (default %(default)s; port 0 picks a free one)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="also start N worker processes connected to this broker",
    )
    _add_broker_options(p)

    p = sub.add_parser(
        "broker", help="run one broker of a highly available cluster (ZooKeeper, shared ledgers)"
    )
    p.add_argument(
        "--zookeeper",
        required=True,
        metavar="HOST:PORT[,...]",
        help="ZooKeeper connect string (env STEWARD_ZOOKEEPER)",
        default=os.environ.get("STEWARD_ZOOKEEPER"),
    )
    p.add_argument("--cluster", default="steward", help="cluster name (default %(default)s)")
    p.add_argument("--broker-id", required=True, help="unique name of this broker")
    p.add_argument("--data-dir", type=Path, required=True, help="this broker's own directory")
    p.add_argument(
        "--ledgers",
        choices=["file", "pulsar"],
        default="file",
        help="ledger backend: file (--ledger-dir, one host) or pulsar (--pulsar-*)",
    )
    p.add_argument(
        "--ledger-dir",
        type=Path,
        help="file backend: the ledger directory, shared by every broker of the cluster",
    )
    p.add_argument("--pulsar-url", metavar="URL", help="pulsar backend: pulsar://HOST:6650")
    p.add_argument(
        "--pulsar-admin-url",
        metavar="URL",
        help="pulsar backend: http://HOST:8080 (topic deletion, namespace policy check)",
    )
    p.add_argument("--pulsar-tenant", default="public")
    p.add_argument("--pulsar-namespace", default="steward")
    p.add_argument(
        "--pulsar-token",
        default=os.environ.get("STEWARD_PULSAR_TOKEN"),
        help="pulsar backend: auth token (env STEWARD_PULSAR_TOKEN)",
    )
    p.add_argument(
        "--pulsar-flavor",
        choices=["pulsar", "pulsar-lite"],
        default="pulsar",
        help="pulsar: Apache Pulsar >= 2.11 (fencing, batching); pulsar-lite: its safe settings",
    )
    p.add_argument("--http", type=_host_port, default=("127.0.0.1", 8080), metavar="HOST:PORT")
    p.add_argument(
        "--worker-listen",
        type=_host_port,
        default=("127.0.0.1", 0),
        metavar="HOST:PORT",
        help="where workers connect while this broker leads (port 0: a free one, advertised)",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST",
        help="the host name others reach this broker by (default: the --http host; "
        "needed when listening on 0.0.0.0)",
    )
    p.add_argument("--session-timeout-ms", type=int, default=4000)
    p.add_argument(
        "--min-replication",
        type=int,
        default=1,
        help="brokers that must hold an uploaded artifact before its tasks run",
    )
    p.add_argument("--max-replication-wait-ms", type=int, default=60_000)
    p.add_argument(
        "--zookeeper-auth",
        default=os.environ.get("STEWARD_ZOOKEEPER_AUTH"),
        metavar="USER:PASSWORD",
        help="digest credentials: Steward's znodes get an ACL only they open "
        "(env STEWARD_ZOOKEEPER_AUTH)",
    )
    _add_broker_options(p)
    p.add_argument("--ledger-roll-age-s", type=float, default=3600.0)
    p.add_argument("--ledger-retention-h", type=float, default=48.0)

    p = sub.add_parser(
        "worker",
        help="run a worker (steward worker --help for its options)",
        add_help=False,
        prefix_chars="\0",  # hand every argument to the worker's own parser
    )
    p.add_argument("worker_args", nargs=argparse.REMAINDER)

    p = sub.add_parser("demo", help="run the PySpark word-count demo on a temporary cluster")
    p.add_argument("--keep", action="store_true", help="keep the temporary data dir and log")

    p = sub.add_parser("submit", help="submit a task")
    p.add_argument("type", help="task type, e.g. noop or mymodule:function")
    p.add_argument("--tenant", help="default: the token's tenant, or 'default'")
    p.add_argument("--params", type=_json_value, default=None, help="JSON value")
    p.add_argument("--slot")
    p.add_argument("--max-attempts", type=int, default=1)
    p.add_argument("--deadline", help="RFC 3339 time or Unix seconds")
    p.add_argument("--start-after", help="RFC 3339 time or Unix seconds")
    p.add_argument("--resource", type=_resource, action="append", default=[], metavar="N=AMOUNT")
    p.add_argument("--transaction", type=int)
    p.add_argument("--code", help="sha256 of an uploaded code artifact")
    p.add_argument("--count", type=int, default=1, help="submit this many copies in one batch")
    p.add_argument(
        "--track-tree",
        action="store_true",
        help="track the tree of tasks it spawns (with --wait: wait for the whole tree)",
    )
    p.add_argument(
        "--tree-timeout-s", type=float, help="with --track-tree: fail the tree after (default 30)"
    )
    p.add_argument(
        "--wait", action="store_true", help="wait for the tasks to end (progress bar for many)"
    )
    p.add_argument("--timeout-s", type=float, default=None, help="with --wait: give up after")

    p = sub.add_parser("task", help="show one task")
    p.add_argument("id", type=int)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("tasks", help="list tasks")
    p.add_argument("--state")
    p.add_argument("--tenant")
    p.add_argument("--type")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--after", type=int, default=0)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("cancel", help="cancel a task")
    p.add_argument("id", type=int)

    p = sub.add_parser("logs", help="a task attempt's captured stdout, stderr and ctx.logger")
    p.add_argument("id", type=int)
    p.add_argument("--attempt", type=int, help="which attempt (default: the latest)")
    p.add_argument(
        "--follow", "-f", action="store_true", help="keep printing new output until it ends"
    )

    p = sub.add_parser("tenant", help="show or change a tenant's service level")
    p.add_argument("name")
    p.add_argument("--max-waiting", type=int)
    p.add_argument("--max-running", type=int)
    p.add_argument("--weight", type=float)

    p = sub.add_parser("txn", help="begin, commit or roll back a transaction")
    p.add_argument("action", choices=["begin", "commit", "rollback"])
    p.add_argument("id", type=int, nargs="?")
    p.add_argument("--tenant", help="default: the token's tenant, or 'default'")
    p.add_argument("--ttl-s", type=float, default=60.0)

    p = sub.add_parser("code", help="code artifacts")
    code_sub = p.add_subparsers(dest="code_command", required=True, metavar="ACTION")
    p = code_sub.add_parser("upload", help="upload a .py, .zip or .whl; prints its sha256")
    p.add_argument("file", type=Path)
    p.add_argument("--name", help="artifact name (default: the file name)")
    code_sub.add_parser("list", help="list uploaded artifacts")

    sub.add_parser("status", help="brokers, workers, tenants and task counts as tables")
    p = sub.add_parser(
        "cluster",
        help="show the cluster summary; 'cluster up' runs a local HA cluster",
        description="steward cluster: print the cluster summary. steward cluster up: start "
        "ZooKeeper, N brokers and M workers on this machine until Ctrl-C or SIGTERM.",
    )
    p.add_argument("action", nargs="?", choices=["up"], help="up: run a local cluster")
    p.add_argument("--brokers", type=int, default=3, help="cluster up: brokers (default 3)")
    p.add_argument("--workers", type=int, default=2, help="cluster up: workers (default 2)")
    p.add_argument(
        "--data-dir", type=Path, default=Path("cluster-data"), help="cluster up: state dir"
    )
    p.add_argument("--session-timeout-ms", type=int, default=4000)
    p.add_argument(
        "--first-http-port",
        type=int,
        default=0,
        help="cluster up: brokers listen on this port and the next ones (default: free ports)",
    )
    _add_log_format_option(p)  # cluster up: passed on to brokers and workers
    p.add_argument("--min-replication", type=int, default=1)
    p.add_argument(
        "--ledgers",
        choices=["file", "pulsar"],
        default="file",
        help="cluster up: file ledgers in DIR/ledgers, or pulsar: a pulsar-lite broker beside "
        "ZooKeeper",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="PATH",
        help="cluster up: authentication on, with the token in this file as the admin one "
        "(worker and cluster tokens are made up and passed on)",
    )
    _add_tls_options(p, "cluster up: ", "brokers and workers verify with")
    sub.add_parser("digest", help="show the state digest and log position")

    p = sub.add_parser("token", help="API tokens (admin): create, list, revoke")
    token_sub = p.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    p = token_sub.add_parser("create", help="issue a token; prints its secret once")
    p.add_argument("name", help="what the token is for (shown in lists)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--tenant", help="a token acting for this tenant only")
    who.add_argument("--admin", action="store_true", help="an admin token")
    who.add_argument(
        "--worker",
        action="store_true",
        help="a worker credential (for steward worker --token-file): binds each worker "
        "connection to its worker id and to --tenants",
    )
    p.add_argument(
        "--tenants",
        type=_tenant_list,
        metavar="A,B",
        help="with --worker: the only tenants its workers may serve (default: every tenant)",
    )
    token_sub.add_parser("list", help="list tokens (never their secrets)")
    p = token_sub.add_parser("revoke", help="revoke a token at once, on every broker")
    p.add_argument("id")
    sub.add_parser("whoami", help="show the role and tenant of the --token")
    return parser


def _time_option(value: str | None) -> Any:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value  # RFC 3339: the broker validates it


def _print_task(task: dict[str, Any]) -> None:
    fields = [
        "id",
        "type",
        "tenant",
        "state",
        "attempt",
        "max_attempts",
        "slot",
        "transaction",
        "worker",
        "created_at",
        "updated_at",
        "start_after",
        "deadline",
        "finished_at",
        "tree",
        "root",
        "parent",
        "code",
        "resources",
        "params",
        "result",
        "error",
    ]
    for name in fields:
        value = task.get(name)
        if value is None or value == {}:
            continue
        if name in ("params", "result", "resources"):
            value = json.dumps(value)
        elif name == "tree":
            value = tree_status(value)
        print(f"{name:>13}: {value}")


def tree_status(tree: dict[str, Any]) -> str:
    """One line for a tracked root's tree: state, run, timeout and the last failure."""
    text = f"{tree['state']} (run {tree['attempt']}, timeout {tree['timeout_s']:g} s)"
    if tree.get("reason"):
        text += (
            f": {tree['reason']}"
            if tree["state"] == "failed"
            else f", last failure: {tree['reason']}"
        )
    return text


_LOGS_POLL_S: Final = 0.5
# Terminal control characters but newline and tab: task output is untrusted text, and an
# escape sequence must not drive the reader's terminal.
_CONTROL_CHARS: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _print_logs(client: StewardClient, task_id: int, attempt: int | None, follow: bool) -> int:
    """Print an attempt's output; with ``follow`` poll for more until the attempt is over
    (Ctrl-C stops it: main() turns KeyboardInterrupt into exit status 130)."""
    offset = 0
    tty = sys.stdout.isatty()
    while True:
        answer = client.logs(task_id, attempt=attempt, offset=offset)
        if answer["attempt"] >= 1:  # follow the attempt seen first, not a later retry
            attempt = int(answer["attempt"])
        if answer["truncated"]:
            dropped = int(answer["offset"]) - offset
            print(f"[... {dropped} earlier bytes of output dropped ...]", file=sys.stderr)
        text = str(answer["output"])
        if tty:
            text = _CONTROL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
        sys.stdout.write(text)
        sys.stdout.flush()
        offset = int(answer["next_offset"])
        if not follow or answer["complete"]:
            break
        time.sleep(_LOGS_POLL_S)
    if not answer["available"] and offset == 0:
        if not attempt:
            why = "it has not run" + ("" if answer["complete"] else " yet")
        elif not answer["complete"]:
            why = f"attempt {attempt} has written nothing yet"
        else:
            why = f"attempt {attempt} ran outside a task process, or its output is gone"
        print(f"steward: no output captured for task {task_id}: {why}", file=sys.stderr)
    return 0


def _print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    cells = [[str(row.get(c) if row.get(c) is not None else "-") for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


def _wait_for(
    handles: list[TaskHandle], timeout_s: float | None, *, expected: int, tree: bool = False
) -> int:
    """Wait for every handle (``tree``: for the tree each one roots); one line per task
    (or a progress bar for many)."""
    started = time.monotonic()
    deadline = None if timeout_s is None else started + timeout_s
    many = len(handles) > 1 and sys.stdout.isatty()
    failed = expected - len(handles)
    for done, handle in enumerate(handles, start=1):
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            task = handle.wait_tree(remaining) if tree else handle.wait(remaining)
        except TaskTimeoutError:
            what = "the tree of task" if tree else "task"
            print(
                f"\nsteward: {what} {handle.id} not finished within {timeout_s} s", file=sys.stderr
            )
            return 1
        ok = task["tree"]["state"] == "completed" if tree else task["state"] == "finished"
        if not ok:
            failed += 1
        if many:
            print_progress(done, len(handles), started)
        elif tree:
            result = json.dumps(task.get("result")) if ok else ""
            print(f"{task['id']} tree {tree_status(task['tree'])} {result}".rstrip())
        else:
            result = json.dumps(task.get("result")) if task["state"] == "finished" else ""
            error = (task.get("error") or "").strip().splitlines()
            print(f"{task['id']} {task['state']} {result or (error[0] if error else '')}")
    if many:
        states = f"{len(handles) - failed} finished, {failed} failed"
        print(f"{states} in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


def _print_status(client: StewardClient) -> None:
    summary = client.cluster()
    print(f"cluster {summary['cluster_id']}  leader {summary['leader']}\n")
    brokers = [
        {**b, "position": f"{b['position']['ledger_id']}:{b['position']['entry_id']}"}
        for b in summary["brokers"]
    ]
    _print_table(brokers, ["id", "host", "port", "is_leader", "position", "uptime_secs"])
    print()
    if summary["workers"]:
        _print_table(summary["workers"], ["id", "state", "address", "running_tasks", "resources"])
    else:
        print("no workers")
    print()
    tenants = [
        {
            "name": t["name"],
            "weight": t["weight"],
            "max_running": t["max_running"] or "-",
            "max_waiting": t["max_waiting"] or "-",
            **{k: v for k, v in t["counts"].items() if k in ("waiting", "running", "finished")},
            "failed": t["counts"].get("error", 0),
        }
        for t in client.tenants()
    ]
    if tenants:
        columns = ["name", "weight", "max_running", "max_waiting", "waiting", "running"]
        _print_table(tenants, [*columns, "finished", "failed"])
        print()
    print("tasks: " + ", ".join(f"{k}={v}" for k, v in summary["tasks"].items()))


def run_client_command(args: argparse.Namespace) -> int:
    with StewardClient(
        args.url,
        failover_timeout_s=args.failover_timeout_s,
        token=args.token,
        ca_file=args.ca_file,
    ) as client:
        if args.command == "submit":
            task: dict[str, Any] = {
                "type": args.type,
                "params": args.params,
                "max_attempts": args.max_attempts,
            }
            optional = {
                "tenant": args.tenant,
                "slot": args.slot,
                "deadline": _time_option(args.deadline),
                "start_after": _time_option(args.start_after),
                "transaction": args.transaction,
                "code": args.code,
                "resources": dict(args.resource) or None,
                "track_tree": True if args.track_tree else None,
                "tree_timeout_s": args.tree_timeout_s,
            }
            task.update({k: v for k, v in optional.items() if v is not None})
            if args.count < 1:
                raise UsageError("--count must be >= 1")
            if args.count == 1:
                handles = [client.submit(**task)]
            else:
                handles = []
                for result in client.submit_many([task] * args.count):
                    if isinstance(result, StewardError):
                        print(f"error: {result.message}", file=sys.stderr)
                    else:
                        handles.append(result)
            if not args.wait:
                for handle in handles:
                    print(handle.id)
                return 0 if len(handles) == args.count else 1
            return _wait_for(handles, args.timeout_s, expected=args.count, tree=args.track_tree)
        elif args.command == "task":
            found = client.task(args.id)
            if args.json:
                print(json.dumps(found, indent=2))
            else:
                _print_task(found)
        elif args.command == "tasks":
            listing = client.tasks(
                state=args.state,
                tenant=args.tenant,
                type=args.type,
                limit=args.limit,
                after=args.after,
            )
            if args.json:
                print(json.dumps(listing, indent=2))
            else:
                columns = ["id", "type", "tenant", "state", "attempt", "worker", "updated_at"]
                _print_table(listing["tasks"], columns)
                if listing.get("next_after"):
                    print(f"(more: --after {listing['next_after']})")
        elif args.command == "cancel":
            cancelled = client.cancel(args.id)
            print(f"task {cancelled['id']} {cancelled['state']}")
        elif args.command == "logs":
            if args.attempt is not None and args.attempt < 1:
                raise UsageError("--attempt must be >= 1")
            return _print_logs(client, args.id, args.attempt, args.follow)
        elif args.command == "tenant":
            limits = {
                k: v
                for k, v in (
                    ("max_waiting", args.max_waiting),
                    ("max_running", args.max_running),
                    ("weight", args.weight),
                )
                if v is not None
            }
            view = client.set_tenant(args.name, **limits) if limits else client.tenant(args.name)
            print(json.dumps(view, indent=2))
        elif args.command == "txn":
            if args.action == "begin":
                print(client.begin(tenant=args.tenant, ttl_s=args.ttl_s))
            else:
                if args.id is None:
                    raise UsageError(f"txn {args.action} needs the transaction id")
                done = (
                    client.commit(args.id) if args.action == "commit" else client.rollback(args.id)
                )
                print(f"transaction {done['id']} {done['outcome']}: tasks {done['tasks']}")
        elif args.command == "code":
            if args.code_command == "upload":
                if not args.file.is_file():
                    raise UsageError(f"{args.file} is not a file")
                print(client.upload_code(args.file, name=args.name))
            else:
                _print_table(client.code(), ["sha256", "name", "size_bytes", "created_at"])
        elif args.command == "status":
            _print_status(client)
        elif args.command == "cluster":
            summary = client.cluster()
            brokers = [
                {**b, "position": f"{b['position']['ledger_id']}:{b['position']['entry_id']}"}
                for b in summary["brokers"]
            ]
            print(f"cluster {summary['cluster_id']}  leader {summary['leader']}")
            _print_table(
                brokers, ["id", "host", "port", "is_leader", "position", "uptime_secs", "version"]
            )
            print("tasks: " + ", ".join(f"{k}={v}" for k, v in summary["tasks"].items()))
            print(f"workers: {len(summary['workers'])}  tenants: {summary['tenants']}")
        elif args.command == "token":
            if args.token_command == "create":
                if args.tenants is not None and not args.worker:
                    raise UsageError("--tenants goes with --worker (a worker credential's scope)")
                created = client.create_token(
                    args.name,
                    tenant=args.tenant,
                    admin=args.admin,
                    worker=args.worker,
                    tenants=args.tenants,
                )
                print(
                    f"token {created['id']} ({created['role']}"
                    + (f" of tenant {created['tenant']}" if created["tenant"] else "")
                    + (f" serving {','.join(created['tenants'])}" if created.get("tenants") else "")
                    + "); its secret, shown only now:"
                )
                print(created["token"])
            elif args.token_command == "list":
                tokens = [
                    {**t, "tenants": ",".join(t.get("tenants") or ()) or "-"}
                    for t in client.tokens()
                ]
                _print_table(tokens, ["id", "name", "role", "tenant", "tenants", "created_at"])
            else:
                revoked = client.revoke_token(args.id)
                print(f"token {revoked['id']} revoked")
        elif args.command == "whoami":
            print(json.dumps(client.whoami(), indent=2))
        elif args.command == "digest":
            d = client.digest()
            print(f"{d['position']['ledger_id']}:{d['position']['entry_id']} {d['digest']}")
    return 0


def _auth_config(args: argparse.Namespace) -> AuthConfig:
    """Authentication settings of a broker from its options (off without an admin token).

    Sets ``args.worker_token`` and ``args.cluster_token`` to the secrets found (file,
    deprecated command line, environment) and removes the secrets' environment variables,
    so the broker's children (workers it starts get theirs explicitly) inherit none."""
    from broker.security.auth import AuthConfig, SecretOptionError, read_secret, secret_from_options

    def warn(message: str) -> None:
        print(f"steward: warning: {message}", file=sys.stderr, flush=True)

    try:
        args.worker_token = secret_from_options(
            argv_value=args.worker_token,
            argv_flag="--worker-token",
            file=args.worker_token_file,
            file_flag="--worker-token-file",
            env="STEWARD_WORKER_TOKEN",
            warn=warn,
        )
        args.cluster_token = secret_from_options(
            argv_value=args.cluster_token,
            argv_flag="--cluster-token",
            file=args.cluster_token_file,
            file_flag="--cluster-token-file",
            env="STEWARD_CLUSTER_TOKEN",
            warn=warn,
        )
    except SecretOptionError as exc:
        raise UsageError(str(exc)) from None
    admin_tokens: list[str] = []
    admin_from_env = os.environ.pop("STEWARD_ADMIN_TOKEN", None)
    if args.admin_token_file is not None:
        try:
            admin_tokens.append(read_secret(args.admin_token_file))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--admin-token-file: {exc}") from None
    elif admin_from_env:
        admin_tokens.append(admin_from_env)
    return AuthConfig.from_secrets(admin_tokens, args.worker_token, args.cluster_token)


def run_standalone(args: argparse.Namespace) -> int:

    import uvloop

    from broker.api.http_api import ApiConfig
    from broker.observability.logs import LOG_FORMAT_ENV, setup_logging
    from broker.replication.node import BrokerStartupError, NodeConfig
    from broker.server.standalone import StandaloneConfig, serve_standalone
    from broker.workers.worker_link import WorkerLinkConfig

    setup_logging(args.log_level, args.log_format)
    # Worker processes started beside the broker (--workers) log the same way.
    os.environ[LOG_FORMAT_ENV] = args.log_format
    host, port = args.http
    auth = _auth_config(args)
    if auth.enabled and args.worker_token is None and args.workers > 0:
        # Other workers may use worker credentials; the ones started here share a token.
        raise UsageError(
            "with authentication on, the --workers started here need a shared token: "
            "give --worker-token-file PATH (or STEWARD_WORKER_TOKEN)"
        )
    config = StandaloneConfig(
        node=NodeConfig(
            data_dir=args.data_dir,
            snapshot_interval_s=args.snapshot_interval_s,
            ledger_roll_bytes=int(args.ledger_roll_mb * 1024 * 1024),
        ),
        api=ApiConfig(host=host, port=port, auth=auth, edges=_http_edges(args)),
        workers=WorkerLinkConfig(
            host=args.worker_listen[0],
            port=args.worker_listen[1],
            heartbeat_interval_ms=args.heartbeat_interval_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            hello_timeout_s=args.worker_hello_timeout_s,
            max_unauthenticated=args.worker_max_unauthenticated,
            token=args.worker_token,
            tenant_isolation=auth.enabled,
            worker_credentials=auth.enabled,
            max_output_total_bytes=int(args.max_task_output_mb * 1024 * 1024),
        ),
        child_workers=args.workers,
        tls=_tls_config(args),
    )
    if args.workers < 0:
        raise UsageError("--workers must be >= 0")
    if not 0 < args.heartbeat_interval_ms < args.heartbeat_timeout_ms:
        raise UsageError("need 0 < --heartbeat-interval-ms < --heartbeat-timeout-ms")
    try:
        uvloop.run(serve_standalone(config))
    except BrokerStartupError as exc:
        print(f"steward: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


def _pulsar_config(args: argparse.Namespace) -> PulsarConfig | None:
    from log.pulsar import PulsarConfig

    if args.ledgers != "pulsar":
        return None
    settings = {
        "admin_url": args.pulsar_admin_url,
        "tenant": args.pulsar_tenant,
        "namespace": args.pulsar_namespace,
        "cluster": args.cluster,
        "auth_token": args.pulsar_token,
    }
    try:
        if args.pulsar_flavor == "pulsar-lite":
            return PulsarConfig.for_pulsar_lite(args.pulsar_url, **settings)
        return PulsarConfig.for_apache_pulsar(args.pulsar_url, **settings)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_broker(args: argparse.Namespace) -> int:
    import uvloop

    from broker.api.http_api import ApiConfig
    from broker.observability.logs import setup_logging
    from broker.replication.node import BrokerStartupError, NodeConfig
    from broker.server.cluster import BrokerConfig, serve_broker
    from broker.workers.worker_link import WorkerLinkConfig

    setup_logging(args.log_level, args.log_format, static_fields={"broker": args.broker_id})
    if not args.zookeeper:
        raise UsageError("--zookeeper is required (or env STEWARD_ZOOKEEPER)")
    if not 1 <= args.session_timeout_ms <= 600_000:
        raise UsageError("--session-timeout-ms must be in [1, 600000]")
    if args.min_replication < 1:
        raise UsageError("--min-replication must be >= 1")
    if args.ledgers == "file" and args.ledger_dir is None:
        raise UsageError("--ledgers file needs --ledger-dir")
    if args.ledgers == "pulsar" and not args.pulsar_url:
        raise UsageError("--ledgers pulsar needs --pulsar-url")
    if not 0 < args.heartbeat_interval_ms < args.heartbeat_timeout_ms:
        raise UsageError("need 0 < --heartbeat-interval-ms < --heartbeat-timeout-ms")
    host, port = args.http
    auth = _auth_config(args)
    if auth.enabled and args.cluster_token is None:
        # Workers need no shared token: they may use worker credentials (token create --worker).
        raise UsageError(
            "with authentication on, give --cluster-token-file PATH (or STEWARD_CLUSTER_TOKEN) too"
        )
    if args.zookeeper_auth is not None and ":" not in args.zookeeper_auth:
        raise UsageError("--zookeeper-auth must be USER:PASSWORD")
    config = BrokerConfig(
        node=NodeConfig(
            data_dir=args.data_dir,
            broker_id=args.broker_id,
            cluster_id=args.cluster,
            snapshot_interval_s=args.snapshot_interval_s,
            ledger_roll_bytes=int(args.ledger_roll_mb * 1024 * 1024),
            ledger_roll_age_ms=int(args.ledger_roll_age_s * 1000),
            ledger_retention_ms=int(args.ledger_retention_h * 3600 * 1000),
        ),
        zookeeper=args.zookeeper,
        ledger_dir=args.ledger_dir,
        ledgers=args.ledgers,
        pulsar=_pulsar_config(args),
        advertise_host=args.advertise,
        api=ApiConfig(host=host, port=port, auth=auth, edges=_http_edges(args)),
        workers=WorkerLinkConfig(
            host=args.worker_listen[0],
            port=args.worker_listen[1],
            heartbeat_interval_ms=args.heartbeat_interval_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            hello_timeout_s=args.worker_hello_timeout_s,
            max_unauthenticated=args.worker_max_unauthenticated,
            token=args.worker_token,
            tenant_isolation=auth.enabled,
            worker_credentials=auth.enabled,
            max_output_total_bytes=int(args.max_task_output_mb * 1024 * 1024),
        ),
        cluster_token=args.cluster_token,
        zookeeper_auth=args.zookeeper_auth,
        session_timeout_ms=args.session_timeout_ms,
        min_replication=args.min_replication,
        max_replication_wait_ms=args.max_replication_wait_ms,
        tls=_tls_config(args),
    )
    try:
        uvloop.run(serve_broker(config))
    except BrokerStartupError as exc:
        print(f"steward: cannot start: {exc}", file=sys.stderr)
        return 2
    # Everything is closed and flushed (ledger, snapshot, ZooKeeper sessions). Leave without
    # the interpreter's teardown: pulsar-client's C++ threads can abort the process in
    # static destructors at exit ("terminate called without an active exception").
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_cluster_up(args: argparse.Namespace) -> int:
    from clients.dev.local_cluster import LocalClusterConfig, run_local_cluster
    from clients.dev.zk import ZooKeeperError

    if args.brokers < 1 or args.workers < 0:
        raise UsageError("need --brokers >= 1 and --workers >= 0")
    if not 1000 <= args.session_timeout_ms <= 60_000:
        raise UsageError("--session-timeout-ms must be in [1000, 60000]")
    config = LocalClusterConfig(
        data_dir=args.data_dir,
        brokers=args.brokers,
        workers=args.workers,
        session_timeout_ms=args.session_timeout_ms,
        first_http_port=args.first_http_port,
        log_format=args.log_format,
        min_replication=args.min_replication,
        ledgers=args.ledgers,
        tls=_tls_config(args),
        admin_token_file=args.admin_token_file,
    )
    try:
        return run_local_cluster(config)
    except (RuntimeError, ZooKeeperError, OSError, ValueError) as exc:
        print(f"steward: cluster up failed: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "standalone":
            return run_standalone(args)
        if args.command == "broker":
            return run_broker(args)
        if args.command == "cluster" and args.action == "up":
            return run_cluster_up(args)
        if args.command == "worker":
            from clients.worker.__main__ import main as worker_main

            return worker_main(args.worker_args)
        if args.command == "demo":
            from clients.demo.run import run_demo

            return run_demo(keep=args.keep)
        return run_client_command(args)
    except CertificateVerifyError as exc:
        print(
            f"steward: {exc} (give the CA bundle that signed the broker's certificate with "
            f"--ca-file or {CA_ENV})",
            file=sys.stderr,
        )
        return 1
    except StewardError as exc:
        print(f"steward: {exc}", file=sys.stderr)
        return 1
    except (UsageError, TlsConfigError) as exc:
        print(f"steward: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
