"""The client commands (``steward submit``, ``tasks``, ``tenant``, ``token``, ``status``,
...): one call on the broker API each, through :class:`~clients.client.StewardClient`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from clients.cli.options import UsageError
from clients.cli.output import (
    _print_brokers,
    _print_logs,
    _print_status,
    _print_table,
    _print_task,
    _wait_for,
)
from clients.client import (
    StewardClient,
    StewardError,
)


def _time_option(value: str | None) -> Any:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value  # RFC 3339: the broker validates it


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
            print(f"cluster {summary['cluster_id']}  leader {summary['leader']}")
            _print_brokers(summary["brokers"])
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
