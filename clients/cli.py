"""The ``steward`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clients.client import StewardClient, StewardError

DEFAULT_URL = "http://127.0.0.1:8080"


class UsageError(Exception):
    pass


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def _resource(text: str) -> tuple[str, float]:
    name, sep, amount = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steward", description="Steward: a highly available resource manager for tasks"
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("STEWARD_URL", DEFAULT_URL),
        help="broker URL for client commands (env STEWARD_URL; default %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("standalone", help="run one standalone broker (no ZooKeeper)")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="default: ./data")
    p.add_argument("--http", type=_host_port, default=("127.0.0.1", 8080), metavar="HOST:PORT")
    p.add_argument("--snapshot-interval-s", type=float, default=60.0)
    p.add_argument("--ledger-roll-mb", type=float, default=64.0)
    p.add_argument("--log-level", default="INFO")

    p = sub.add_parser("submit", help="submit a task")
    p.add_argument("type", help="task type, e.g. noop or mymodule:function")
    p.add_argument("--tenant", default="default")
    p.add_argument("--params", type=_json_value, default=None, help="JSON value")
    p.add_argument("--slot")
    p.add_argument("--max-attempts", type=int, default=1)
    p.add_argument("--deadline", help="RFC 3339 time or Unix seconds")
    p.add_argument("--start-after", help="RFC 3339 time or Unix seconds")
    p.add_argument("--resource", type=_resource, action="append", default=[], metavar="N=AMOUNT")
    p.add_argument("--transaction", type=int)
    p.add_argument("--code", help="sha256 of an uploaded code artifact")
    p.add_argument("--count", type=int, default=1, help="submit this many copies in one batch")

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

    p = sub.add_parser("tenant", help="show or change a tenant's service level")
    p.add_argument("name")
    p.add_argument("--max-waiting", type=int)
    p.add_argument("--max-running", type=int)
    p.add_argument("--weight", type=float)

    p = sub.add_parser("txn", help="begin, commit or roll back a transaction")
    p.add_argument("action", choices=["begin", "commit", "rollback"])
    p.add_argument("id", type=int, nargs="?")
    p.add_argument("--tenant", default="default")
    p.add_argument("--ttl-s", type=float, default=60.0)

    sub.add_parser("cluster", help="show the cluster summary")
    sub.add_parser("digest", help="show the state digest and log position")
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
        print(f"{name:>13}: {value}")


def _print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    cells = [[str(row.get(c) if row.get(c) is not None else "-") for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


def run_client_command(args: argparse.Namespace) -> int:
    with StewardClient(args.url) as client:
        if args.command == "submit":
            task: dict[str, Any] = {
                "type": args.type,
                "tenant": args.tenant,
                "params": args.params,
                "max_attempts": args.max_attempts,
            }
            optional = {
                "slot": args.slot,
                "deadline": _time_option(args.deadline),
                "start_after": _time_option(args.start_after),
                "transaction": args.transaction,
                "code": args.code,
                "resources": dict(args.resource) or None,
            }
            task.update({k: v for k, v in optional.items() if v is not None})
            if args.count < 1:
                raise UsageError("--count must be >= 1")
            if args.count == 1:
                print(client.submit(**task).id)
            else:
                failed = 0
                for result in client.submit_many([task] * args.count):
                    if isinstance(result, StewardError):
                        failed += 1
                        print(f"error: {result.message}", file=sys.stderr)
                    else:
                        print(result.id)
                return 1 if failed else 0
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
        elif args.command == "digest":
            d = client.digest()
            print(f"{d['position']['ledger_id']}:{d['position']['entry_id']} {d['digest']}")
    return 0


def run_standalone(args: argparse.Namespace) -> int:

    import uvloop

    from broker.http_api import ApiConfig
    from broker.node import BrokerStartupError, NodeConfig
    from broker.standalone import StandaloneConfig, serve_standalone

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    host, port = args.http
    config = StandaloneConfig(
        node=NodeConfig(
            data_dir=args.data_dir,
            snapshot_interval_s=args.snapshot_interval_s,
            ledger_roll_bytes=int(args.ledger_roll_mb * 1024 * 1024),
        ),
        api=ApiConfig(host=host, port=port),
    )
    try:
        uvloop.run(serve_standalone(config))
    except BrokerStartupError as exc:
        print(f"steward: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "standalone":
            return run_standalone(args)
        return run_client_command(args)
    except StewardError as exc:
        print(f"steward: {exc}", file=sys.stderr)
        return 1
    except UsageError as exc:
        print(f"steward: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
