"""The PySpark job `steward demo` uploads as a code artifact.

Task type ``wordcount_job:count_words``; params ``{"lines": [str, ...]}``.
Counts words with Spark DataFrames (so it runs on the worker's Spark Connect server,
``ctx.spark``) and returns ``{"counts": {word: n}, "lines": n}``. The tokenizing runs in
Spark as a Java regex equal to ``WORD_RE``: no Python UDF (on Connect, UDFs run on the
server, which does not have this artifact's modules).
"""

from __future__ import annotations

import re
from typing import Any

WORD_RE = re.compile(r"[a-z][a-z']+")


def words_of(line: str) -> list[str]:
    """The tokenizer both Spark and the plain-Python check use."""
    return WORD_RE.findall(line.lower())


def count_words(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    from pyspark.sql import functions as sf

    lines: list[str] = params["lines"]
    spark = ctx.spark
    df = spark.createDataFrame([(line,) for line in lines], "line string")
    words = df.select(
        sf.explode(
            sf.regexp_extract_all(sf.lower("line"), sf.lit(WORD_RE.pattern), sf.lit(0))
        ).alias("word")
    )
    counts = words.groupBy("word").count()
    ctx.logger.info("counting %d lines", len(lines))
    return {"counts": {row["word"]: row["count"] for row in counts.collect()}, "lines": len(lines)}
