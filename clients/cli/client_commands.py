"""The client commands (``steward submit``, ``tasks``, ``tenant``, ``token``, ``status``,
...): one call on the broker API each, through :class:`~clients.client.StewardClient`.

Every read command prints a table or ``name: value`` lines, or with ``--json`` the API's
answer; hints (the next page) go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from clients.cli.options import NotStewardError, UsageError
from clients.cli.output import (
    _print_logs,
    _print_status,
    _print_table,
    _print_task,
    _print_tree,
    _wait_for,
    cell,
    hint,
    print_fields,
    print_json,
    unreachable_reason,
)
from clients.client import (
    CertificateVerifyError,
    ConnectionFailedError,
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
        try:
            return _dispatch(client, args)
        except (KeyError, TypeError, AttributeError) as exc:
            # An answer without the API's fields: whatever listens there is no broker
            # (a web server answering 200 with a page, say).
            raise NotStewardError(f"an answer that is not Steward's JSON API: {exc}") from None


def _cancel(client: StewardClient, args: argparse.Namespace) -> None:
    filters = (args.tenant, args.type, args.state, args.tree, args.submitted_before)
    named = any(f is not None for f in filters)
    if (args.id is not None) == named:
        raise UsageError("give a task id, or filters (--tenant, --type, --state, ...), not both")
    if args.id is not None:
        cancelled = client.cancel(args.id)
        print_json(cancelled) if args.json else print(
            f"task {cancelled['id']} {cancelled['state']}"
        )
        return
    done = client.cancel_matching(
        tenant=args.tenant,
        type=args.type,
        state=args.state,
        tree=args.tree,
        submitted_before=_time_option(args.submitted_before),
        reason=args.reason,
    )
    print_json(done) if args.json else print(
        f"{done['cancelled']} cancelled of {done['matched']} matching "
        f"({done['skipped']} ended meanwhile)"
    )


def _is_write(args: argparse.Namespace) -> bool:
    if args.command in ("submit", "cancel", "txn"):
        return True
    if args.command == "tenant":
        limits = (args.max_waiting, args.max_running, args.weight, args.submit_rate)
        return any(v is not None for v in (*limits, args.submit_burst))
    if args.command == "code":
        return bool(args.code_command in ("upload", "delete"))
    if args.command == "schedule":
        return bool(args.schedule_command != "list")
    return bool(args.command == "token" and args.token_command != "list")


def _say_if_nothing_answers(client: StewardClient, args: argparse.Namespace) -> None:
    """A write keeps trying for --failover-timeout-s while a leader takes over; when no
    URL answers at all (a wrong port, say), tell the person at once instead of after it."""
    try:
        client.health()
    except CertificateVerifyError:
        raise  # the write would fail the same way, at once
    except ConnectionFailedError as exc:
        hint(
            f"steward: nothing answers at {','.join(args.url)} ({unreachable_reason(exc)}); "
            f"trying for up to {args.failover_timeout_s:g} s (--failover-timeout-s)"
        )
    except StewardError:
        pass  # a broker answered: the write goes on as usual


def _dispatch(client: StewardClient, args: argparse.Namespace) -> int:
    command = args.command
    if _is_write(args):
        _say_if_nothing_answers(client, args)
    if command == "submit":
        return _submit(client, args)
    if command == "logs":
        if args.attempt is not None and args.attempt < 1:
            raise UsageError("--attempt must be >= 1")
        return _print_logs(client, args.id, args.attempt, args.follow)
    if command in ("status", "cluster"):
        _print_status(client, args.json)
    elif command == "task":
        found = client.task(args.id)
        print_json(found) if args.json else _print_task(found)
    elif command == "tree":
        found = client.tree(args.root)
        print_json(found) if args.json else _print_tree(found)
    elif command == "tasks":
        _tasks(client, args)
    elif command == "cancel":
        _cancel(client, args)
    elif command == "tenant":
        _tenant(client, args)
    elif command == "txn":
        _txn(client, args)
    elif command == "code":
        _code(client, args)
    elif command == "token":
        _token(client, args)
    elif command == "schedule":
        _schedule(client, args)
    elif command == "whoami":
        who = client.whoami()
        if args.json:
            print_json(who)
        else:
            auth = "on" if who.get("auth") else "off (every caller is an admin)"
            print_fields(
                [
                    ("role", who["role"]),
                    ("tenant", who["tenant"]),
                    ("token", who["token_id"]),
                    ("authentication", auth),
                ]
            )
    elif command == "digest":
        d = client.digest()
        position = f"{d['position']['ledger_id']}:{d['position']['entry_id']}"
        print_json(d) if args.json else print_fields(
            [("position", position), ("digest", d["digest"])]
        )
    return 0


def _submit(client: StewardClient, args: argparse.Namespace) -> int:
    task: dict[str, Any] = {
        "type": args.type,
        "params": args.params,
        "max_attempts": args.max_attempts,
    }
    optional = {
        "tenant": args.tenant,
        "slot": args.slot,
        "max_lost": args.max_lost,
        "deadline": _time_option(args.deadline),
        "start_after": _time_option(args.start_after),
        "transaction": args.transaction,
        "code": args.code,
        "resources": dict(args.resource) or None,
        "track_tree": True if args.track_tree else None,
        "tree_timeout_s": args.tree_timeout_s,
        "after": args.after or None,
        "allow_unknown_type": True if args.allow_unknown_type else None,
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
                print(f"steward: {result}", file=sys.stderr)
            else:
                handles.append(result)
    if args.wait:
        return _wait_for(
            handles, args.timeout_s, expected=args.count, tree=args.track_tree, as_json=args.json
        )
    if args.json:
        print_json([{"id": handle.id} for handle in handles])
    else:
        for handle in handles:
            print(handle.id)
    return 0 if len(handles) == args.count else 1


def _tasks(client: StewardClient, args: argparse.Namespace) -> None:
    listing = client.tasks(
        state=args.state, tenant=args.tenant, type=args.type, limit=args.limit, after=args.after
    )
    if args.json:
        print_json(listing)
        return
    columns = ["id", "type", "tenant", "state", "attempt", "worker", "updated_at"]
    _print_table(listing["tasks"], columns)
    sys.stdout.flush()  # the table before the hint, when both go to one terminal
    if listing.get("next_after"):
        hint(f"(more: steward tasks --after {listing['next_after']})")


def _tenant(client: StewardClient, args: argparse.Namespace) -> None:
    limits = {
        k: v
        for k, v in (
            ("max_waiting", args.max_waiting),
            ("max_running", args.max_running),
            ("weight", args.weight),
            ("submit_rate", args.submit_rate),
            ("submit_burst", args.submit_burst),
        )
        if v is not None
    }
    view = client.set_tenant(args.name, **limits) if limits else client.tenant(args.name)
    if args.json:
        print_json(view)
        return
    counts = {k: v for k, v in view["counts"].items() if v}
    print_fields(
        [
            ("tenant", view["name"]),
            ("weight", view["weight"]),
            ("max_running", view["max_running"] or "0 (unlimited)"),
            ("max_waiting", view["max_waiting"] or "0 (unlimited)"),
            (
                "submit_rate",
                f"{view['submit_rate']:g}/s" if view.get("submit_rate") else "0 (unlimited)",
            ),
            ("tasks", cell(counts) if counts else "none"),
        ]
    )


def _txn(client: StewardClient, args: argparse.Namespace) -> None:
    if args.action == "begin":
        print(client.begin(tenant=args.tenant, ttl_s=args.ttl_s))
        return
    if args.id is None:
        raise UsageError(
            f"txn {args.action} needs the transaction id: steward txn {args.action} ID"
        )
    done = client.commit(args.id) if args.action == "commit" else client.rollback(args.id)
    print(f"transaction {done['id']} {done['outcome']}: tasks {cell(done['tasks'])}")


def _code(client: StewardClient, args: argparse.Namespace) -> None:
    if args.code_command == "upload":
        if not args.file.is_file():
            raise UsageError(f"{args.file} is not a file")
        print(client.upload_code(args.file, name=args.name))
        return
    if args.code_command == "delete":
        deleted = client.delete_code(args.sha256)
        print(f"deleted code artifact {deleted['sha256']} ({deleted['name']})")
        return
    artifacts = client.code()
    if args.json:
        print_json(artifacts)
    else:
        _print_table(artifacts, ["sha256", "name", "size_bytes", "created_at"])


def _token(client: StewardClient, args: argparse.Namespace) -> None:
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
        tokens = client.tokens()
        if args.json:
            print_json(tokens)
        else:
            _print_table(tokens, ["id", "name", "role", "tenant", "tenants", "created_at"])
    else:
        revoked = client.revoke_token(args.id)
        print(f"token {revoked['id']} revoked")


def _schedule(client: StewardClient, args: argparse.Namespace) -> None:
    if args.schedule_command == "create":
        created = client.create_schedule(
            args.name,
            args.type,
            args.params,
            tenant=args.tenant,
            cron=args.cron,
            interval_s=args.interval_s,
            missed=args.missed,
            grace_s=args.grace_s,
            max_attempts=args.max_attempts,
            max_lost=args.max_lost,
        )
        if args.json:
            print_json(created)
        else:
            print(f"schedule {created['name']} of {created['tenant']}: next {created['next_tick']}")
    elif args.schedule_command == "list":
        found = client.schedules(args.tenant)
        if args.json:
            print_json(found)
            return
        for item in found:
            item["every"] = item.get("cron") or f"{item.get('interval_s'):g} s"
            item["type"] = item["task"]["type"]
        columns = [
            *("tenant", "name", "type", "every", "missed", "next_tick", "runs", "skipped"),
            "paused",
        ]
        _print_table(found, columns)
    elif args.schedule_command in ("pause", "resume"):
        pause = args.schedule_command == "pause"
        call = client.pause_schedule if pause else client.resume_schedule
        view = call(args.name, tenant=args.tenant)
        state = f"paused since {view['paused_at']}" if view["paused"] else "running"
        print(f"schedule {view['name']} of {view['tenant']}: {state}")
    else:
        deleted = client.delete_schedule(args.name, tenant=args.tenant)
        print(f"schedule {deleted['name']} of {deleted['tenant']} deleted")
