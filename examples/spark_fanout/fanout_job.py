"""The code artifact of the PySpark fan-out example: one tracked task tree per run.

Task types (uploaded as ``fanout_job.py``; children inherit the root's artifact):

``fanout_job:root`` ``{"rows", "partitions", "out_dir", "engine"?, "child_sleep_s"?,
"child_max_attempts"?, "child_max_lost"?}``
    splits the rows ``0 .. rows-1`` into ``partitions`` ranges, spawns one
    ``partition`` child per range and the ``combine`` child joined to all of them;
    returns where the answer will be (``final``).
``fanout_job:partition`` ``{"run_dir", "index", "partitions", "start", "end", ...}``
    aggregates its range with Spark DataFrame ops (``engine`` "python": plain Python,
    for tests without Spark) and writes ``part-NNNN.json``.
``fanout_job:combine`` ``{"run_dir", "partitions"}``
    merges the partials and writes ``final.json`` (also its result).

The combiner is a join (Storm's multi-anchoring): anchored to every partition, it waits
until all of them finished, so every partial is there when it runs, and the tree
completes only after it. A partition that fails for good fails the tree (the combiner is
cancelled), and the root's replay starts over in a fresh run dir. Each partition
publishes its partial atomically (a temporary file, then a rename).

The run dir is unique to the root's attempt (``root-ID/attempt-N``): late writes of
a failed run's partitions land in their own run's dir and never mix into a replay.
The dataset is generated, so that every run and the direct check agree: row ``i``
has ``key = i % 7`` and ``value = (i * 7919) % 1000``. The run dir must be on a
file system every worker sees (one host here; a shared volume in a cluster).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

MODULE = "fanout_job"
KEYS = 7
MULTIPLIER = 7919
MODULUS = 1000
ENGINES = ("spark", "python")
MAX_PARTITIONS = 1000
FINAL_FILE = "final.json"


def key_of(i: int) -> int:
    return i % KEYS


def value_of(i: int) -> int:
    return (i * MULTIPLIER) % MODULUS


# --- aggregates: what a partition writes, how partials merge, the direct computation ---


def empty_aggregate() -> dict[str, Any]:
    return {
        "rows": 0,
        "sum": 0,
        "sum_squares": 0,
        "min": None,
        "max": None,
        "by_key": {},
    }


def python_aggregate(start: int, end: int) -> dict[str, Any]:
    """The aggregate of rows ``start .. end-1`` in plain Python (the direct computation)."""
    agg = empty_aggregate()
    by_key: dict[str, dict[str, int]] = {}
    for i in range(start, end):
        value = value_of(i)
        agg["rows"] += 1
        agg["sum"] += value
        agg["sum_squares"] += value * value
        agg["min"] = value if agg["min"] is None else min(agg["min"], value)
        agg["max"] = value if agg["max"] is None else max(agg["max"], value)
        slot = by_key.setdefault(str(key_of(i)), {"rows": 0, "sum": 0})
        slot["rows"] += 1
        slot["sum"] += value
    agg["by_key"] = dict(sorted(by_key.items()))
    return agg


def spark_aggregate(spark: Any, start: int, end: int) -> dict[str, Any]:
    """The same aggregate with Spark DataFrame ops: one job, grouped by key; the
    totals over the (at most ``KEYS``) groups are summed here."""
    from pyspark.sql import functions as sf

    rows = spark.range(start, end).select(
        (sf.col("id") % KEYS).alias("key"),
        ((sf.col("id") * MULTIPLIER) % MODULUS).alias("value"),
    )
    per_key = rows.groupBy("key").agg(
        sf.count(sf.lit(1)).alias("rows"),
        sf.sum("value").alias("sum"),
        sf.sum(sf.col("value") * sf.col("value")).alias("sum_squares"),
        sf.min("value").alias("min"),
        sf.max("value").alias("max"),
    )
    groups = []
    for row in sorted(per_key.collect(), key=lambda row: int(row["key"])):
        key = str(row["key"])
        group: dict[str, Any] = {
            name: int(row[name]) for name in ("rows", "sum", "sum_squares", "min", "max")
        }
        group["by_key"] = {key: {"rows": group["rows"], "sum": group["sum"]}}
        groups.append(group)
    return merge(groups)


def merge(partials: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine partial aggregates (all fields are integers: exact in any order)."""
    total = empty_aggregate()
    by_key: dict[str, dict[str, int]] = {}
    for part in partials:
        total["rows"] += part["rows"]
        total["sum"] += part["sum"]
        total["sum_squares"] += part["sum_squares"]
        for field, pick in (("min", min), ("max", max)):
            if part[field] is not None:
                total[field] = (
                    part[field] if total[field] is None else pick(total[field], part[field])
                )
        for key, slot in part["by_key"].items():
            into = by_key.setdefault(key, {"rows": 0, "sum": 0})
            into["rows"] += slot["rows"]
            into["sum"] += slot["sum"]
    total["by_key"] = dict(sorted(by_key.items(), key=lambda item: int(item[0])))
    return total


def split(rows: int, partitions: int) -> list[tuple[int, int]]:
    """``partitions`` contiguous ranges covering ``0 .. rows-1``, sizes differing by <= 1."""
    size, extra = divmod(rows, partitions)
    bounds: list[tuple[int, int]] = []
    start = 0
    for index in range(partitions):
        end = start + size + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


# --- files ---------------------------------------------------------------------------


def partial_path(run_dir: Path, index: int) -> Path:
    return run_dir / f"part-{index:04d}.json"


def write_json_atomic(path: Path, value: Any) -> None:
    """Readers see the whole file or none (rename is atomic within a directory)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps(value, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


# --- task functions --------------------------------------------------------------------


def _int_param(
    params: dict[str, Any], name: str, low: int, high: int | None = None, default: Any = None
) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value}")
    return value


def _pause(params: dict[str, Any], ctx: Any) -> None:
    """An optional delay (tests kill or stop a worker while children run)."""
    seconds = float(params.get("child_sleep_s", 0.0))
    if seconds > 0 and ctx.cancelled.wait(seconds):
        ctx.check_cancelled()


def root(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    rows = _int_param(params, "rows", 1)
    partitions = _int_param(params, "partitions", 1, min(rows, MAX_PARTITIONS))
    engine = params.get("engine", "spark")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    child_max_attempts = _int_param(params, "child_max_attempts", 1, default=1)
    # Attempts a child may lose with its worker (the broker's default when not given).
    lost: dict[str, int] = {}
    if "child_max_lost" in params:
        lost["max_lost"] = _int_param(params, "child_max_lost", 0, 100)
    child_sleep_s = params.get("child_sleep_s", 0.0)
    if isinstance(child_sleep_s, bool) or not isinstance(child_sleep_s, int | float):
        raise ValueError(f"child_sleep_s must be a number, got {child_sleep_s!r}")
    if not 0 <= child_sleep_s <= 3600:
        raise ValueError(f"child_sleep_s must be between 0 and 3600, got {child_sleep_s}")
    out_dir = params.get("out_dir")
    if not isinstance(out_dir, str) or not out_dir:
        raise ValueError("out_dir must be a directory path every worker can write")
    # A fresh dir per run of the root: a replay never reads a failed run's partials.
    run_dir = Path(out_dir) / f"root-{ctx.task_id}" / f"attempt-{ctx.attempt}"
    run_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for index, (start, end) in enumerate(split(rows, partitions)):
        child = {
            "run_dir": str(run_dir),
            "index": index,
            "partitions": partitions,
            "start": start,
            "end": end,
            "engine": engine,
            "child_sleep_s": child_sleep_s,
            "child_max_attempts": child_max_attempts,
        }
        parts.append(
            ctx.spawn(f"{MODULE}:partition", child, max_attempts=child_max_attempts, **lost)
        )
    # The join: anchored to every partition, it runs once all of them finished.
    ctx.spawn(
        f"{MODULE}:combine",
        {"run_dir": str(run_dir), "partitions": partitions},
        anchors=parts,
        max_attempts=child_max_attempts,
        **lost,
    )
    ctx.logger.info("fan-out of %d rows over %d partitions in %s", rows, partitions, run_dir)
    return {
        "run_dir": str(run_dir),
        "final": str(run_dir / FINAL_FILE),
        "rows": rows,
        "partitions": partitions,
        "attempt": ctx.attempt,
    }


def partition(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    run_dir = Path(params["run_dir"])
    index, partitions = int(params["index"]), int(params["partitions"])
    start, end = int(params["start"]), int(params["end"])
    _pause(params, ctx)
    if params.get("engine", "spark") == "python":
        aggregate = python_aggregate(start, end)
    else:
        aggregate = spark_aggregate(ctx.spark, start, end)
    ctx.check_cancelled()  # a cancelled run's partition publishes nothing
    write_json_atomic(partial_path(run_dir, index), aggregate)
    return {"index": index, "partitions": partitions, "rows": aggregate["rows"]}


def combine(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    run_dir = Path(params["run_dir"])
    partitions = int(params["partitions"])
    partials = []
    for index in range(partitions):
        path = partial_path(run_dir, index)
        if not path.exists():
            raise RuntimeError(f"partial {path} is missing")
        partials.append(json.loads(path.read_text(encoding="utf-8")))
    answer = merge(partials)
    write_json_atomic(run_dir / FINAL_FILE, answer)
    ctx.logger.info("combined %d partials: %d rows", partitions, answer["rows"])
    return answer
