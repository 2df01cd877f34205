"""Output of the client commands: tasks, trees, task logs, tables, waiting for tasks and
the cluster status.

Human output is tables and ``name: value`` lines, never a Python repr (a dict shows as
``cpu=2, memory_mb=512``, a flag as yes/no); ``--json`` prints the API's answer for
scripts. Data goes to stdout; hints and progress to stderr, so a pipe gets only data.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from typing import Any, Final

from clients.cli.waiting import NOTICE_AFTER_S, stopped_waiting_line, waiting_notice
from clients.client import (
    ConnectionFailedError,
    StewardClient,
    StewardError,
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
        "lost",
        "max_lost",
        "slot",
        "transaction",
        "worker",
        "worker_state",  # "disconnected": presumed lost (docs/API.md, "Lost workers")
        "lost_suspected_at",
        "created_at",
        "updated_at",
        "start_after",
        "deadline",
        "queued_ms",  # before started_at: waiting, then running (docs/API.md, "Task times")
        "started_at",
        "finished_at",
        "tree",
        "root",
        "parent",
        "progress",
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
        if name in ("params", "result"):
            value = json.dumps(value)  # the task's own JSON values, as submitted/returned
        elif name == "tree":
            value = tree_status(value)
        elif name == "progress":
            value = progress_line(value)
        else:
            value = cell(value)
        print(f"{name:>13}: {value}")


def _print_tree(tree: dict[str, Any]) -> None:
    """A tree as ``name: value`` lines, then its tasks by state as a table."""
    anchors = cell(tree.get("pending_anchors"))
    if tree.get("pending_count", 0) > len(tree.get("pending_anchors") or ()):
        anchors += f" (of {tree['pending_count']})"
    pairs = [
        ("root", tree["root"]),
        ("tenant", tree["tenant"]),
        ("state", tree["state"]),
        ("attempt", tree["attempt"]),
        ("age_s", round(tree["age_s"], 3)),
        ("timeout_s", tree["timeout_s"]),
        ("started_at", tree["started_at"]),
        ("deadline", tree.get("deadline")),
        ("ended_at", tree.get("ended_at")),
        ("reason", tree.get("reason")),
        ("pending", f"{tree['pending_count']} acks awaited: {anchors}"),
    ]
    for name, value in pairs:
        if value is not None:
            print(f"{name:>10}: {cell(value)}")
    counts = tree.get("tasks") or {}
    _print_table([{"state": k, "tasks": v} for k, v in counts.items() if v], ["state", "tasks"])


def progress_line(progress: dict[str, Any]) -> str:
    """A progress report as one line: ``45% copying part 3 (attempt 1, at TIME)``."""
    percent = f"{progress['fraction'] * 100:.0f}%"
    message = f" {progress['message']}" if progress.get("message") else ""
    return f"{percent}{message} (attempt {progress['attempt']}, at {progress['updated_at']})"


def cell(value: Any) -> str:
    """One value as a person reads it: ``-`` for none, yes/no, 2 not 2.0, ``k=v, k=v``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={cell(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list | tuple):
        return ", ".join(cell(v) for v in value) or "-"
    return str(value)


def print_fields(pairs: list[tuple[str, Any]]) -> None:
    """``name: value`` lines, the names right-aligned."""
    width = max((len(name) for name, _ in pairs), default=0)
    for name, value in pairs:
        print(f"{name:>{width}}: {value if isinstance(value, str) else cell(value)}")


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def hint(text: str) -> None:
    """A hint for the person at the terminal: stderr, never into a pipe's data."""
    print(text, file=sys.stderr)


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
    notice_at: float | None = time.monotonic() + NOTICE_AFTER_S if follow else None
    while True:
        answer = client.logs(task_id, attempt=attempt, offset=offset)
        if answer["attempt"] >= 1:  # follow the attempt seen first, not a later retry
            attempt = int(answer["attempt"])
            notice_at = None  # it started: its output is what the reader waits for
        elif notice_at is not None and time.monotonic() >= notice_at and not answer["complete"]:
            notice_at = None
            hint(waiting_notice(client, client.task(task_id)))
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
    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


def _outcome(task: dict[str, Any], tree: bool) -> str:
    """One readable line for a task that ended: ``task 52 finished: result slept=0.1``."""
    if tree:
        line = f"task {task['id']} tree {tree_status(task['tree'])}"
        ok = task["tree"]["state"] == "completed"
    else:
        line = f"task {task['id']} {task['state']}"
        ok = task["state"] == "finished"
    if ok and task.get("result") is not None:
        return f"{line}: result {cell(task['result'])}"
    error = (task.get("error") or "").strip().splitlines()
    return f"{line}: {error[0]}" if not ok and error else line


def _wait_for(
    handles: list[TaskHandle],
    timeout_s: float | None,
    *,
    expected: int,
    tree: bool = False,
    as_json: bool = False,
) -> int:
    """Wait for every handle (``tree``: for the tree each one roots); one line per task
    (or a progress bar on stderr for many; ``as_json``: the final records as JSON)."""
    started = time.monotonic()
    deadline = None if timeout_s is None else started + timeout_s
    many = len(handles) > 1 and sys.stderr.isatty()
    failed = expected - len(handles)
    records = []
    noticed = False  # one notice per wait: the first task that keeps it waiting
    for done, handle in enumerate(handles, start=1):
        try:
            if not noticed:
                task, noticed = _wait_noticed(handle, deadline, tree)
            else:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                task = handle.wait_tree(remaining) if tree else handle.wait(remaining)
        except KeyboardInterrupt:
            print(file=sys.stderr)  # past the ^C the terminal echoed
            hint(stopped_waiting_line([h.id for h in handles[done - 1 :]]))
            raise
        except TaskTimeoutError:
            what = "the tree of task" if tree else "task"
            print(
                f"\nsteward: {what} {handle.id} not finished within {timeout_s} s (raise "
                "--timeout-s, or look later with steward task ID)",
                file=sys.stderr,
            )
            return 1
        ok = task["tree"]["state"] == "completed" if tree else task["state"] == "finished"
        if not ok:
            failed += 1
        records.append(task)
        if many:
            with contextlib.redirect_stdout(sys.stderr):
                print_progress(done, len(handles), started)
        elif not as_json:
            print(_outcome(task, tree))
    if as_json:
        print_json(records)
    elif many:
        states = f"{len(handles) - failed} finished, {failed} failed"
        print(f"{states} in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


def _wait_noticed(
    handle: TaskHandle, deadline: float | None, tree: bool
) -> tuple[dict[str, Any], bool]:
    """Wait for one handle as :func:`_wait_for` does; after ``NOTICE_AFTER_S`` without an
    end, say on stderr what it waits for (then True: noticed)."""
    wait = handle.wait_tree if tree else handle.wait
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    if remaining is not None and remaining <= NOTICE_AFTER_S:
        return wait(remaining), False
    try:
        return wait(NOTICE_AFTER_S), False
    except TaskTimeoutError:
        try:
            hint(waiting_notice(handle.client, handle.info(), tree=tree))
        except StewardError:  # the notice is a courtesy: the wait goes on without it
            hint(f"steward: waiting for task {handle.id} (Ctrl-C stops waiting, it goes on)")
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    return wait(remaining), True


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


def _print_status(client: StewardClient, as_json: bool = False) -> None:
    summary = client.cluster()
    if as_json:
        print_json({"cluster": summary, "tenants": client.tenants()})
        return
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
            "max_running": t["max_running"] or "0 (unlimited)",  # as the API and the dashboard say
            "max_waiting": t["max_waiting"] or "0 (unlimited)",
            **{k: v for k, v in t["counts"].items() if k in ("waiting", "running", "finished")},
            "error": t["counts"].get("error", 0),  # the API's word, as the dashboard says
        }
        for t in client.tenants()
    ]
    if tenants:
        columns = ["name", "weight", "max_running", "max_waiting", "waiting", "running"]
        _print_table(tenants, [*columns, "finished", "error"])
        print()
    print("tasks: " + ", ".join(f"{k}={v}" for k, v in summary["tasks"].items()))


def unreachable_reason(exc: ConnectionFailedError) -> str:
    """What a connection failure was, in words: refused, TLS, or the reason itself."""
    reason = str(exc.message).partition(": ")[2] or exc.message
    lowered = reason.lower()
    if "refused" in lowered:
        return "connection refused"
    if "ssl" in lowered or "tls" in lowered or "certificate" in lowered:
        return f"a TLS error: {reason}; is it https:// or http://?"
    if "closed the connection" in lowered or "reset" in lowered:
        # What the worker port (binary frames) does to an HTTP request.
        return f"no HTTP answer: {reason}; is this the worker port, or an https:// one?"
    return reason
