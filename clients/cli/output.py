"""Output of the client commands: tasks, trees, task logs, tables, waiting for tasks and
the cluster status."""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any, Final

from clients.client import (
    StewardClient,
    TaskHandle,
    TaskTimeoutError,
)
from clients.progress import print_progress


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


def _duration(secs: float) -> str:
    """12.3s, 4m05s, 3h07m, 2d04h: short enough for a table cell."""
    if secs < 60:
        return f"{secs:.1f}s"
    minutes, seconds = divmod(int(secs), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _position(position: dict[str, int] | None) -> str:
    if position is None:
        return "unknown"
    if position["ledger_id"] < 0:
        return "empty"  # nothing logged yet: the API says -1:-1
    return f"{position['ledger_id']}:{position['entry_id']}"


def _broker_state(broker: dict[str, Any]) -> str:
    if broker.get("reachable", True):
        return "ok"
    seen = broker.get("last_seen_secs_ago")
    when = "never seen" if seen is None else f"last seen {_duration(seen)} ago"
    left = "" if broker.get("member", True) else ", left the cluster"
    return f"UNREACHABLE ({when}{left})"


def _print_brokers(brokers: list[dict[str, Any]]) -> None:
    """The brokers table of ``steward status`` and ``steward cluster``: what is unknown
    (an unreachable broker's position, uptime, lag) shows as "unknown"."""
    rows = []
    for b in brokers:
        position = b.get("position")
        uptime = b.get("uptime_secs")
        lag = b.get("lag_entries")
        rows.append(
            {
                "id": b["id"],
                "url": b.get("url") or f"{b['host']}:{b['port']}",
                "role": b.get("role", "-"),
                "position": _position(position),
                "lag": "unknown" if lag is None else lag,
                "uptime": "unknown" if uptime is None else _duration(uptime),
                "version": b.get("version") or "unknown",
                "state": _broker_state(b),
            }
        )
    columns = ["id", "url", "role", "position", "lag", "uptime", "version", "state"]
    _print_table(rows, columns)
    for b in brokers:
        if b.get("unknown_reason"):
            print(f"  {b['id']}: {b['unknown_reason']}")
    if any(not b.get("reachable", True) for b in brokers):
        print(
            "  (an unreachable broker: check its process and its log; brokers that left"
            " are listed for 10 minutes)"
        )


def _print_status(client: StewardClient) -> None:
    summary = client.cluster()
    seen_by = summary["brokers"][0]["id"] if summary["brokers"] else "?"
    leader = summary["leader"] or "none known"
    print(f"cluster {summary['cluster_id']}  leader {leader}  (as seen by {seen_by})\n")
    _print_brokers(summary["brokers"])
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
