"""The ``steward`` argument parser: every command and its options."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from broker.security.tls import CA_ENV
from clients.cli.options import (
    DEFAULT_FAILOVER_TIMEOUT_S,
    DEFAULT_URL,
    _add_broker_options,
    _add_listen_options,
    _add_log_format_option,
    _add_path_option,
    _add_tls_options,
    _broker_urls,
    _json_value,
    _positive_seconds,
    _resource,
    _tenant_list,
)


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
    _add_path_option(
        parser,
        "--ca-file",
        CA_ENV,
        f"CA bundle to verify https:// brokers with (env {CA_ENV}; default: the "
        "system trust store)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("standalone", help="run one standalone broker (no ZooKeeper)")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="default: ./data")
    _add_listen_options(
        p,
        ("127.0.0.1", 7070),
        "where workers connect (default %(default)s; port 0 picks a free one)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="also start N worker processes connected to this broker",
    )
    p.add_argument(
        "--stop-grace-s",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="on SIGTERM/Ctrl-C, let running tasks finish this long, then give the rest"
        " back to the queue (not counted as failed; 0: at once; default: %(default)s)",
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
    _add_listen_options(
        p,
        ("127.0.0.1", 0),
        "where workers connect while this broker leads (port 0: a free one, advertised)",
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
