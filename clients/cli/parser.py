"""The ``steward`` argument parser: every command and its options.

Conventions (issue 17): the client options (--url, --token, ...) go before or after the
command; every option has a help text naming its default; every read command takes
--json; no option is abbreviated; ``cluster`` only groups ``cluster status`` (a read) and
``cluster up`` (the local launcher).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from pathlib import Path

from broker.security.tls import CA_ENV
from clients.cli.options import (
    TASK_STATES,
    StewardArgumentParser,
    _add_broker_options,
    _add_listen_options,
    _add_log_format_option,
    _add_tls_options,
    _json_value,
    _resource,
    _tenant_list,
    add_client_options,
    add_json_option,
)

_EPILOG = f"""\
environment:
  STEWARD_URL     default of --url (a broker's HTTP URL, or several, comma-separated)
  STEWARD_TOKEN   default of --token (the API token of a broker with authentication)
  STEWARD_FAILOVER_TIMEOUT_S, {CA_ENV}: defaults of --failover-timeout-s, --ca-file

The client options may come before or after the command:
  steward --url http://127.0.0.1:8080 tasks  ==  steward tasks --url http://127.0.0.1:8080
"""


CLUSTER_HINT = (
    "`steward cluster` takes an action first: `steward cluster status` shows the cluster "
    "(as `steward status`); `steward cluster up --broker-count N` starts a local one"
)


def version_text() -> str:
    """What ``steward --version`` prints: the installed distribution's version."""
    try:
        version = metadata.version("steward")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    python = ".".join(str(n) for n in sys.version_info[:3])
    return f"steward {version} (Python {python})"


def _client(
    sub: argparse._SubParsersAction[StewardArgumentParser], name: str, help: str
) -> StewardArgumentParser:
    """A client command: it takes the client options after its name too."""
    p = sub.add_parser(name, help=help)
    add_client_options(p)
    return p


def build_parser() -> StewardArgumentParser:
    parser = StewardArgumentParser(
        prog="steward",
        description="Steward: a highly available resource manager for tasks",
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action="version", version=version_text())
    add_client_options(parser, top=True)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=StewardArgumentParser
    )
    _add_server_commands(sub)
    _add_task_commands(sub)
    _add_admin_commands(sub)
    _add_cluster_commands(sub)
    return parser


def _add_server_commands(sub: argparse._SubParsersAction[StewardArgumentParser]) -> None:
    p = sub.add_parser("standalone", help="run one standalone broker (no ZooKeeper)")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path("data"),
        metavar="DIR",
        help="where the ledgers and snapshots live (created if missing)",
    )
    _add_listen_options(p, ("127.0.0.1", 7070), "where workers connect (port 0 picks a free one)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="also start N worker processes connected to this broker (0: none)",
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
        required=not os.environ.get("STEWARD_ZOOKEEPER"),
        metavar="HOST:PORT[,...]",
        help="ZooKeeper connect string (env STEWARD_ZOOKEEPER)",
        default=os.environ.get("STEWARD_ZOOKEEPER"),
    )
    p.add_argument(
        "--cluster", default="steward", metavar="NAME", help="the cluster's name in ZooKeeper"
    )
    p.add_argument("--broker-id", required=True, metavar="ID", help="unique name of this broker")
    p.add_argument(
        "--data-dir", type=Path, required=True, metavar="DIR", help="this broker's own directory"
    )
    p.add_argument(
        "--ledgers",
        choices=["file", "pulsar"],
        default="file",
        help="ledger backend, one of %(choices)s: file (--ledger-dir, one host) or pulsar "
        "(--pulsar-*)",
    )
    p.add_argument(
        "--ledger-dir",
        type=Path,
        metavar="DIR",
        help="file backend: the ledger directory, shared by every broker of the cluster",
    )
    p.add_argument("--pulsar-url", metavar="URL", help="pulsar backend: pulsar://HOST:6650")
    p.add_argument(
        "--pulsar-admin-url",
        metavar="URL",
        help="pulsar backend: http://HOST:8080 (topic deletion, namespace policy check)",
    )
    p.add_argument("--pulsar-tenant", default="public", help="pulsar backend: the Pulsar tenant")
    p.add_argument(
        "--pulsar-namespace", default="steward", help="pulsar backend: the Pulsar namespace"
    )
    p.add_argument(
        "--pulsar-token",
        default=os.environ.get("STEWARD_PULSAR_TOKEN"),
        help="pulsar backend: auth token (env STEWARD_PULSAR_TOKEN; default: none)",
    )
    p.add_argument(
        "--pulsar-tls-ca-file",
        type=Path,
        metavar="PATH",
        help="pulsar backend: CA certificates (PEM) to verify pulsar+ssl:// and https:// "
        "admin URLs with (default: the usual trusted CAs)",
    )
    p.add_argument(
        "--pulsar-tls-cert-file",
        type=Path,
        metavar="PATH",
        help="pulsar backend: client certificate (PEM) for Pulsar requiring mutual TLS; "
        "with --pulsar-tls-key-file",
    )
    p.add_argument(
        "--pulsar-tls-key-file",
        type=Path,
        metavar="PATH",
        help="pulsar backend: the client certificate's private key (PEM)",
    )
    p.add_argument(
        "--pulsar-flavor",
        choices=["pulsar", "pulsar-lite"],
        default="pulsar",
        help="one of %(choices)s: pulsar: Apache Pulsar >= 2.11 (fencing, LZ4); "
        "pulsar-lite: its safe settings",
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
    p.add_argument(
        "--session-timeout-ms",
        type=int,
        default=4000,
        metavar="MS",
        help="ZooKeeper session timeout: a silent leader is replaced after about this long",
    )
    p.add_argument(
        "--min-replication",
        type=int,
        default=1,
        metavar="N",
        help="brokers that must hold an uploaded artifact before its tasks run",
    )
    p.add_argument(
        "--max-replication-wait-ms",
        type=int,
        default=60_000,
        metavar="MS",
        help="how long an artifact's tasks wait for --min-replication copies before running "
        "(-1: wait forever)",
    )
    p.add_argument(
        "--snapshot-source-wait-s",
        type=float,
        default=300.0,
        metavar="S",
        help="a broker that needs a snapshot (its history was deleted) and finds none, at a "
        "peer or in its snapshots directory, for this long exits non-zero",
    )
    p.add_argument(
        "--zookeeper-auth",
        default=os.environ.get("STEWARD_ZOOKEEPER_AUTH"),
        metavar="USER:PASSWORD",
        help="digest credentials: Steward's znodes get an ACL only they open "
        "(env STEWARD_ZOOKEEPER_AUTH; default: none, open znodes)",
    )
    _add_broker_options(p)
    p.add_argument(
        "--ledger-roll-age-s",
        type=float,
        default=3600.0,
        metavar="S",
        help="start a new ledger once the current one is this old",
    )
    p.add_argument(
        "--ledger-retention-h",
        type=float,
        default=48.0,
        metavar="H",
        help="delete ledgers a snapshot covers once they are this old",
    )

    p = sub.add_parser(
        "worker",
        help="run a worker (steward worker --help for its options)",
        add_help=False,
        prefix_chars="\0",  # hand every argument to the worker's own parser
    )
    p.add_argument("worker_args", nargs=argparse.REMAINDER, help="the worker's options")

    p = sub.add_parser("demo", help="run the PySpark word-count demo on a temporary cluster")
    p.add_argument("--keep", action="store_true", help="keep the temporary data dir and log")


def _add_task_commands(sub: argparse._SubParsersAction[StewardArgumentParser]) -> None:
    p = _client(sub, "submit", help="submit a task")
    p.add_argument(
        "type", help="task type: noop, sleep, fail, spark.sql or module:function (TASKS.md)"
    )
    p.add_argument("--tenant", help="default: the token's tenant, or 'default'")
    p.add_argument(
        "--params",
        type=_json_value,
        default=None,
        metavar="JSON",
        help="the task's parameters as JSON, e.g. '{\"seconds\": 1}' for sleep (default: null)",
    )
    p.add_argument(
        "--slot",
        metavar="NAME",
        help="at most one live task per slot name (default: none, no such limit)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=1,
        metavar="N",
        help="run it up to N times when it fails (1: no retry; attempts lost with a worker "
        "do not count, see --max-lost)",
    )
    p.add_argument(
        "--max-lost",
        type=int,
        metavar="N",
        help="attempts it may lose with its worker (dead, or back without it) before it fails "
        "(0-100; default: 3)",
    )
    p.add_argument(
        "--deadline",
        metavar="TIME",
        help="RFC 3339 time or Unix seconds after which it fails (default: none)",
    )
    p.add_argument(
        "--start-after",
        metavar="TIME",
        help="RFC 3339 time or Unix seconds before which it does not start (default: now)",
    )
    p.add_argument(
        "--resource",
        type=_resource,
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="a resource it needs, e.g. cpu=2 (repeatable; default: none)",
    )
    p.add_argument(
        "--transaction",
        type=int,
        metavar="ID",
        help="submit inside this open transaction (steward txn begin; default: none)",
    )
    p.add_argument(
        "--code",
        metavar="SHA256",
        help="sha256 of an uploaded code artifact (steward code upload; default: none)",
    )
    p.add_argument(
        "--allow-unknown-type",
        action="store_true",
        help="submit a type no worker is known to run: a plain name no worker serving the"
        " tenant registered yet, or module:function without --code (a name an embedded worker"
        " registers itself)",
    )
    p.add_argument(
        "--count", type=int, default=1, metavar="N", help="submit this many copies in one batch"
    )
    p.add_argument(
        "--track-tree",
        action="store_true",
        help="track the tree of tasks it spawns (with --wait: wait for the whole tree)",
    )
    p.add_argument(
        "--tree-timeout-s",
        type=float,
        metavar="S",
        help="with --track-tree: fail the tree after this long (default 30)",
    )
    p.add_argument(
        "--after",
        type=int,
        action="append",
        default=[],
        metavar="ID",
        help="run after this task finished (repeatable; it fails if that one fails)",
    )
    p.add_argument(
        "--wait", action="store_true", help="wait for the tasks to end (progress bar for many)"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="with --wait: give up after this long (default: wait for ever)",
    )
    add_json_option(p)

    p = _client(sub, "task", help="show one task")
    p.add_argument("id", type=int, help="the task's id")
    add_json_option(p)

    p = _client(sub, "tree", help="show a tracked task tree: state, age, tasks, pending acks")
    p.add_argument("root", type=int, help="the id of the tree's root task")
    add_json_option(p)

    p = _client(sub, "tasks", help="list tasks, ascending ids")
    p.add_argument(
        "--state",
        choices=TASK_STATES,
        metavar="STATE",
        help="only tasks in this state: %(choices)s (default: any)",
    )
    p.add_argument("--tenant", help="only this tenant's tasks (default: any)")
    p.add_argument("--type", help="only tasks of this type (default: any)")
    p.add_argument(
        "--limit",
        type=int,
        default=50,
        metavar="N",
        help="at most N tasks (1 to the broker's limit: 1000 unless configured)",
    )
    p.add_argument(
        "--after",
        type=int,
        default=0,
        metavar="ID",
        help="only ids above this one: the next page (0: from the first)",
    )
    add_json_option(p)

    p = _client(sub, "cancel", help="cancel a task, or the live tasks matching filters")
    p.add_argument("id", type=int, nargs="?", help="the task's id (or give filters instead)")
    p.add_argument("--tenant", help="filter: this tenant's tasks (a tenant token: its own)")
    p.add_argument("--type", help="filter: tasks of this type")
    p.add_argument(
        "--state", choices=("pending", "delayed", "waiting", "running"), help="filter: a state"
    )
    p.add_argument("--tree", type=int, metavar="ROOT", help="filter: the tree of this root")
    p.add_argument(
        "--submitted-before", metavar="TIME", help="filter: RFC 3339 time or Unix seconds"
    )
    p.add_argument("--reason", help="the cancelled tasks' error (default: cancelled by request)")
    add_json_option(p)

    p = _client(sub, "logs", help="a task attempt's captured stdout, stderr and ctx.logger")
    p.add_argument("id", type=int, help="the task's id")
    p.add_argument("--attempt", type=int, metavar="N", help="which attempt (default: the latest)")
    p.add_argument(
        "--follow", "-f", action="store_true", help="keep printing new output until it ends"
    )

    p = _client(sub, "txn", help="begin, commit or roll back a transaction")
    p.add_argument("action", choices=["begin", "commit", "rollback"], help="%(choices)s")
    p.add_argument("id", type=int, nargs="?", help="the transaction (commit, rollback)")
    p.add_argument("--tenant", help="begin: default: the token's tenant, or 'default'")
    p.add_argument(
        "--ttl-s",
        type=float,
        default=60.0,
        metavar="S",
        help="begin: roll back by itself unless committed within this",
    )

    p = _client(sub, "code", help="code artifacts: upload, list, delete")
    code_sub = p.add_subparsers(dest="code_command", required=True, metavar="ACTION")
    p = _client(code_sub, "upload", help="upload a .py, .zip or .whl; prints its sha256")
    p.add_argument("file", type=Path, help="the file to upload")
    p.add_argument("--name", help="artifact name (default: the file name)")
    p = _client(code_sub, "list", help="list uploaded artifacts")
    add_json_option(p)
    p = _client(
        code_sub,
        "delete",
        help="delete an artifact (refused while a task that has not ended needs it)",
    )
    p.add_argument("sha256", help="the artifact's sha256")


def _add_admin_commands(sub: argparse._SubParsersAction[StewardArgumentParser]) -> None:
    p = _client(sub, "tenant", help="show or change a tenant's service level")
    p.add_argument("name", help="the tenant's name")
    p.add_argument(
        "--max-waiting",
        type=int,
        metavar="N",
        help="queued tasks it may have; more are refused with 429 (0: unlimited)",
    )
    p.add_argument(
        "--max-running", type=int, metavar="N", help="tasks it may run at once (0: unlimited)"
    )
    p.add_argument(
        "--weight", type=float, metavar="W", help="its share of the workers against other tenants"
    )
    p.add_argument(
        "--submit-rate",
        type=float,
        metavar="PER_S",
        help="tasks/s the leader accepts from it; more are refused with 429 (0: unlimited)",
    )
    p.add_argument(
        "--submit-burst",
        type=int,
        metavar="N",
        help="tasks it may submit at once above the rate (0: one second's worth)",
    )
    add_json_option(p)

    p = _client(sub, "schedule", help="periodic tasks: create, list, pause, delete schedules")
    schedule_sub = p.add_subparsers(dest="schedule_command", required=True, metavar="ACTION")
    p = _client(schedule_sub, "create", help="run a task at each tick of a cron or interval")
    p.add_argument("name", help="the schedule's name (its tenant's own)")
    p.add_argument("--type", required=True, help="the task type each tick runs")
    p.add_argument(
        "--params", type=_json_value, default=None, metavar="JSON", help="the task's parameters"
    )
    p.add_argument("--tenant", help="default: the token's tenant, or 'default'")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", metavar="EXPR", help="a cron expression (5 fields; UTC)")
    when.add_argument("--interval-s", type=float, metavar="S", help="a tick every S seconds")
    p.add_argument(
        "--missed",
        choices=("skip", "run_once", "run_all"),
        default="skip",
        help="ticks no leader fired in time: drop them, run them once, or run each",
    )
    p.add_argument(
        "--grace-s", type=float, metavar="S", help="with skip: a tick later than this is dropped"
    )
    p.add_argument("--max-attempts", type=int, default=1, metavar="N", help="each task's")
    p.add_argument("--max-lost", type=int, metavar="N", help="each task's (default: 3)")
    add_json_option(p)
    p = _client(schedule_sub, "list", help="list schedules with their runs and next tick")
    p.add_argument("--tenant", help="an admin's filter (a tenant token sees its own)")
    add_json_option(p)
    for action, what in (
        ("delete", "delete a schedule (its tasks stay)"),
        ("pause", "stop a schedule firing until resumed (it keeps its definition)"),
        ("resume", "fire a paused schedule again (its missed policy handles the ticks passed)"),
    ):
        p = _client(schedule_sub, action, help=what)
        p.add_argument("name", help="the schedule's name")
        p.add_argument("--tenant", help="default: the token's tenant, or 'default'")

    p = _client(sub, "digest", help="show the state digest and log position")
    add_json_option(p)
    p = _client(sub, "whoami", help="show the role and tenant of the --token")
    add_json_option(p)

    p = _client(sub, "token", help="API tokens (admin): create, list, revoke")
    token_sub = p.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    p = _client(token_sub, "create", help="issue a token; prints its secret once")
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
    p = _client(token_sub, "list", help="list tokens (never their secrets)")
    add_json_option(p)
    p = _client(token_sub, "revoke", help="revoke a token at once, on every broker")
    p.add_argument("id", help="the token's id (steward token list)")


def _add_cluster_commands(sub: argparse._SubParsersAction[StewardArgumentParser]) -> None:
    p = _client(sub, "status", help="brokers, workers, tenants and task counts as tables")
    add_json_option(p)
    p = sub.add_parser(
        "cluster",
        help="'cluster status' shows the cluster; 'cluster up' runs a local HA cluster",
        description="steward cluster status: the cluster (as steward status). steward "
        "cluster up: start ZooKeeper, N brokers and M workers on this machine until Ctrl-C.",
    )
    # Not required here: main() answers a bare `steward cluster [--flags]` with a message
    # that names both actions instead of argparse's "required: ACTION".
    p.usage_hint = CLUSTER_HINT
    cluster_sub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    p = _client(cluster_sub, "status", help="the cluster: brokers, workers, tenants, tasks")
    add_json_option(p)
    p = cluster_sub.add_parser(
        "up",
        help="run a local HA cluster (ZooKeeper, brokers, workers) until Ctrl-C",
        description="start ZooKeeper, N brokers and M workers on this machine until Ctrl-C "
        "or SIGTERM; prints each process's pid and role",
    )
    p.add_argument(
        "--broker-count", type=int, default=3, metavar="N", help="how many brokers to start"
    )
    # Hidden and still accepted (with a warning) so scripts that pass a count keep running;
    # not documented because --brokers means broker URLs everywhere else.
    p.add_argument("--brokers", type=int, dest="brokers_deprecated", help=argparse.SUPPRESS)
    p.add_argument(
        "--workers", type=int, default=2, metavar="N", help="how many workers to start (0: none)"
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path("cluster-data"),
        metavar="DIR",
        help="the brokers', ZooKeeper's and the workers' state",
    )
    p.add_argument(
        "--session-timeout-ms",
        type=int,
        default=4000,
        metavar="MS",
        help="ZooKeeper session timeout: a killed leader is replaced after about this long",
    )
    p.add_argument(
        "--first-http-port",
        type=int,
        default=0,
        metavar="PORT",
        help="brokers listen on this port and the next ones (0: free ports)",
    )
    _add_log_format_option(p)  # passed on to brokers and workers
    p.add_argument(
        "--min-replication",
        type=int,
        default=1,
        metavar="N",
        help="brokers that must hold an uploaded artifact before its tasks run",
    )
    p.add_argument(
        "--ledgers",
        choices=["file", "pulsar"],
        default="file",
        help="one of %(choices)s: file ledgers in DIR/ledgers, or pulsar: a Pulsar server "
        "beside ZooKeeper (--pulsar-flavor)",
    )
    p.add_argument(
        "--pulsar-flavor",
        choices=["pulsar", "pulsar-lite"],
        default="pulsar",
        help="with --ledgers pulsar, one of %(choices)s: pulsar: an Apache Pulsar standalone "
        "from the engines cache (./scripts/fetch-engines in a checkout, or env "
        "STEWARD_ENGINES_DIR); pulsar-lite: the light one",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="PATH",
        help="authentication on, with the token in this file as the admin one (worker and "
        "cluster tokens are made up and passed on; default: none, authentication off)",
    )
    _add_tls_options(p, "", "brokers and workers verify with")
