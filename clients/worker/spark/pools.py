"""Spark fair-scheduler pools per tenant (docs/DESIGN.md §6, "Spark fairness").

A Spark Connect server shared by a worker's tenants (a worker that is not root, or
``--spark-user``; per-tenant servers have one tenant each and no pools) runs
``spark.scheduler.mode=FAIR``; each task's session
sets ``spark.scheduler.pool`` to its tenant's pool (Spark 4 applies a Connect session's
``spark.scheduler.pool`` to the jobs of that session), so the tenants' Spark jobs share the
server by pool weight, not first come first served.

Spark reads pool weights only from the allocation file, once, when the server starts; a
pool the file does not name is made on first use with weight 1 and keeps it. Steward's
default tenant weight is 1 too, so the file names only the tenants whose weight is not 1:
the broker sends those in its Welcome, and the worker writes the file before it starts the
server. Spark's weights are integers: a tenant's is its weight rounded, at least 1. A tenant
whose weight changes (or a new one with a weight other than 1) after the server started
keeps the weight its pool had until the worker restarts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Final
from xml.sax.saxutils import quoteattr

#: Steward's tenant names (broker/core/validation.py NAME_RE): nothing XML or Spark treats
#: specially; anything else gets no pool of its own.
_TENANT_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PREFIX: Final = "tenant-"  # keeps a tenant called "default" off Spark's default pool


def pool_name(tenant: str) -> str | None:
    """The tenant's pool; None for a name that is not a Steward tenant name."""
    if not _TENANT_RE.fullmatch(tenant):
        return None
    return _PREFIX + tenant


def spark_weight(weight: float) -> int:
    """Spark's integer weight for a tenant's weight (rounded, at least 1)."""
    if not math.isfinite(weight) or weight <= 0:
        return 1
    return max(1, min(1_000_000, round(weight)))


def allocation_xml(weights: Mapping[str, float]) -> str:
    """The allocation file: a FAIR pool per tenant whose Spark weight is not 1."""
    lines = ['<?xml version="1.0"?>', "<allocations>"]
    for tenant in sorted(weights):
        name = pool_name(tenant)
        weight = spark_weight(weights[tenant])
        if name is None or weight == 1:
            continue
        lines.append(
            f"  <pool name={quoteattr(name)}><schedulingMode>FAIR</schedulingMode>"
            f"<weight>{weight}</weight><minShare>0</minShare></pool>"
        )
    lines.append("</allocations>")
    return "\n".join(lines) + "\n"
