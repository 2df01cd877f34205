"""Run the PySpark fan-out example: ``python -m examples.spark_fanout [--url URL]``.

Uploads ``fanout_job.py``, submits one tracked root, waits for its whole task tree
with ``tree_result()``, reads the combined answer the tree wrote and prints it next
to a direct computation in plain Python. Without ``--url`` it starts a standalone
broker and one PySpark worker in a temporary directory (as ``steward demo`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.client import StewardClient, StewardError, TaskHandle, TreeFailedError
from examples.spark_fanout import fanout_job

JOB_PATH = Path(__file__).with_name("fanout_job.py")
ROOT_TYPE = f"{fanout_job.MODULE}:root"
DEFAULT_ROWS = 1_000_000
DEFAULT_PARTITIONS = 8


@dataclass
class FanoutOutcome:
    root_id: int
    root: dict[str, Any]  # the root's task record once its tree ended (with "tree")
    answer: dict[str, Any]  # what the combiner wrote
    final_path: Path
    elapsed_s: float


def upload_job(client: StewardClient) -> str:
    return client.upload_code(JOB_PATH)


def share_out_dir(out_dir: Path) -> Path:
    """Create ``out_dir`` writable by the workers' task users, as /tmp is (sticky, 1777).

    Workers run each tenant's tasks under a uid of its own (docs/SECURITY.md, "Task
    processes"), so the tree's tasks cannot write a directory only this user can; its
    parents must let them through (``o+x``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out_dir, 0o1777)
    return out_dir


def submit_fanout(
    client: StewardClient,
    code: str,
    out_dir: Path,
    *,
    rows: int = DEFAULT_ROWS,
    partitions: int = DEFAULT_PARTITIONS,
    engine: str = "spark",
    tenant: str = "default",
    max_attempts: int = 2,
    tree_timeout_s: float = 120.0,
    child_sleep_s: float = 0.0,
    child_max_attempts: int = 1,
    child_max_lost: int | None = None,
) -> TaskHandle:
    """Submit the tracked root; a failed tree is replayed while ``max_attempts`` allow."""
    share_out_dir(out_dir)
    params = {
        "rows": rows,
        "partitions": partitions,
        "out_dir": str(out_dir),
        "engine": engine,
        "child_sleep_s": child_sleep_s,
        "child_max_attempts": child_max_attempts,
    }
    if child_max_lost is not None:  # None: the broker's default
        params["child_max_lost"] = child_max_lost
    return client.submit(
        ROOT_TYPE,
        params,
        tenant=tenant,
        code=code,
        max_attempts=max_attempts,
        track_tree=True,
        tree_timeout_s=tree_timeout_s,
    )


def wait_fanout(
    handle: TaskHandle, timeout_s: float, started: float | None = None
) -> FanoutOutcome:
    """Wait for the tree; raises TreeFailedError when it failed with no replay left."""
    started = time.monotonic() if started is None else started
    result = handle.tree_result(timeout=timeout_s)
    final_path = Path(result["final"])
    answer = json.loads(final_path.read_text(encoding="utf-8"))
    return FanoutOutcome(
        root_id=handle.id,
        root=handle.info(),
        answer=answer,
        final_path=final_path,
        elapsed_s=time.monotonic() - started,
    )


def run_fanout(
    client: StewardClient, out_dir: Path, *, timeout_s: float = 300.0, **options: Any
) -> FanoutOutcome:
    started = time.monotonic()
    handle = submit_fanout(client, upload_job(client), out_dir, **options)
    return wait_fanout(handle, timeout_s, started)


def direct_answer(rows: int) -> dict[str, Any]:
    """The whole dataset aggregated in one pass of plain Python, no Steward, no Spark."""
    return fanout_job.python_aggregate(0, rows)


def report(outcome: FanoutOutcome, direct: dict[str, Any]) -> bool:
    tree = outcome.root["tree"]
    print(
        f"root task {outcome.root_id}: tree {tree['state']} on attempt {tree['attempt']}"
        f" in {outcome.elapsed_s:.1f} s; answer in {outcome.final_path}"
    )
    print(f"{'':<14}{'fan-out':>16}{'direct':>16}")
    for field in ("rows", "sum", "sum_squares", "min", "max"):
        print(f"{field:<14}{outcome.answer[field]!s:>16}{direct[field]!s:>16}")
    for key in sorted(direct["by_key"], key=int):
        got = outcome.answer["by_key"].get(key, {}).get("sum")
        print(f"{'sum key=' + key:<14}{got!s:>16}{direct['by_key'][key]['sum']!s:>16}")
    same = outcome.answer == direct
    print("the fan-out equals the direct computation" if same else "MISMATCH")
    return same


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.spark_fanout",
        description="A tracked task tree: PySpark partial aggregates, then a combiner.",
    )
    parser.add_argument("--url", help="a running broker (default: start one and a worker)")
    parser.add_argument("--rows", type=_positive_int, default=DEFAULT_ROWS)
    parser.add_argument("--partitions", type=_positive_int, default=DEFAULT_PARTITIONS)
    parser.add_argument(
        "--out-dir", type=Path, help="where the tree writes (default: a temporary dir)"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.partitions > min(args.rows, fanout_job.MAX_PARTITIONS):
        parser.error(f"--partitions must be at most min(--rows, {fanout_job.MAX_PARTITIONS})")
    scratch = Path(tempfile.mkdtemp(prefix="steward-fanout-"))
    os.chmod(scratch, 0o711)  # task users pass through to the shared out dir
    out_dir = args.out_dir if args.out_dir is not None else scratch / "out"
    try:
        options: dict[str, Any] = {"rows": args.rows, "partitions": args.partitions}
        if args.url is not None:
            with StewardClient(args.url) as client:
                outcome = run_fanout(client, out_dir, timeout_s=args.timeout_s, **options)
        else:
            from clients.demo.run import local_cluster

            print(f"starting a standalone broker and a PySpark worker in {scratch} ...")
            with (
                local_cluster(scratch / "data", log=scratch / "steward.log") as url,
                StewardClient(url) as client,
            ):
                outcome = run_fanout(client, out_dir, timeout_s=args.timeout_s, **options)
        return 0 if report(outcome, direct_answer(args.rows)) else 1
    except TreeFailedError as exc:
        print(f"fan-out: the task tree failed: {exc}", file=sys.stderr)
        return 1
    except (StewardError, TimeoutError, OSError, RuntimeError) as exc:
        print(f"fan-out: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # an --out-dir given is kept
