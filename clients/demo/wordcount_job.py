"""The PySpark job `steward demo` uploads as a code artifact.

Task type ``wordcount_job:count_words``; params ``{"lines": [str, ...]}``.
Counts words with Spark on the worker's shared SparkSession and returns
``{"counts": {word: n}, "lines": n}``.
"""

from __future__ import annotations

import re
from typing import Any

WORD_RE = re.compile(r"[a-z][a-z']+")


def words_of(line: str) -> list[str]:
    """The tokenizer both Spark and the plain-Python check use."""
    return WORD_RE.findall(line.lower())


def count_words(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    lines: list[str] = params["lines"]
    spark = ctx.spark
    rdd = spark.sparkContext.parallelize(lines, numSlices=2)
    counts = rdd.flatMap(words_of).map(lambda word: (word, 1)).reduceByKey(lambda a, b: a + b)
    ctx.logger.info("counting %d lines", len(lines))
    return {"counts": dict(counts.collect()), "lines": len(lines)}
