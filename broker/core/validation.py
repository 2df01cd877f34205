"""Validation shared by the API (before logging) and ``apply`` (the authority).

Pure like the state machine (no IO, no clock); ``broker/core/state.py`` re-exports every
name, so other modules import them from one place.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Final

from broker.core import entries as e
from broker.core.backoff import validate_scheduling
from broker.core.entries import SHA256_RE

# \Z, not $: "$" also matches before a final newline, which would let "acme\n" in.
NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
TASK_TYPE_RE: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}\Z")
MAX_SLOT_CHARS: Final = 256
MAX_RESOURCES: Final = 32
MAX_ATTEMPTS_LIMIT: Final = 1000
#: Upper bound of a task's max_lost (attempts lost with their worker, docs/DESIGN.md §6).
MAX_LOST_LIMIT: Final = 100
MAX_TREE_TIMEOUT_MS: Final = 7 * 24 * 3600 * 1000
IDEMPOTENCY_KEY_RE: Final = re.compile(r"[\x20-\x7e]{1,128}")
#: Roles a token created through the API may have (the peer secret and the shared worker
#: token come from the configuration: broker/security/auth.py).
TOKEN_ROLES: Final = frozenset({"admin", "tenant", "worker"})
MAX_TOKEN_TENANTS: Final = 1000
MAX_TOKEN_NAME_CHARS: Final = 200
#: Idempotency keys are kept at least this long, longer when finished tasks are.
IDEMPOTENCY_MIN_RETENTION_MS: Final = 24 * 3600 * 1000
#: At most this many dependencies (``after``) per task: each is an index entry until it ends.
MAX_AFTER: Final = 100
#: Upper bound of a tenant's submit_rate (tasks/s) and submit_burst.
MAX_SUBMIT_RATE: Final = 1_000_000


def validate_task_spec(spec: e.TaskSpec) -> str | None:
    """Why this spec is invalid regardless of state, or None."""
    if not TASK_TYPE_RE.match(spec.type):
        return "type must be 1-128 characters of letters, digits and _ . : -"
    if not NAME_RE.match(spec.tenant):
        return "tenant must be 1-64 characters of letters, digits and _ . - (not first)"
    if spec.slot is not None and not 0 < len(spec.slot) <= MAX_SLOT_CHARS:
        return f"slot must be 1-{MAX_SLOT_CHARS} characters"
    if not 1 <= spec.max_attempts <= MAX_ATTEMPTS_LIMIT:
        return f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}"
    if not 0 <= spec.max_lost <= MAX_LOST_LIMIT:
        return f"max_lost must be between 0 and {MAX_LOST_LIMIT}"
    if len(spec.resources) > MAX_RESOURCES:
        return f"at most {MAX_RESOURCES} resources per task"
    for name, amount in spec.resources.items():
        if not NAME_RE.match(name):
            return f"resource name {name!r} is not valid"
        if not (math.isfinite(amount) and amount >= 0):
            return f"resource {name!r} must be a finite number >= 0"
    if spec.code is not None and not SHA256_RE.fullmatch(spec.code):
        return "code must be the sha256 (64 lowercase hex digits) of an uploaded artifact"
    if spec.track_tree and not 0 < spec.tree_timeout_ms <= MAX_TREE_TIMEOUT_MS:
        return f"tree_timeout_ms must be between 1 and {MAX_TREE_TIMEOUT_MS}"
    if len(spec.after) > MAX_AFTER:
        return f"after holds at most {MAX_AFTER} task ids"
    if len(set(spec.after)) != len(spec.after):
        return "after names a task twice"
    return validate_scheduling(spec.priority, spec.retry_backoff_ms, spec.retry_backoff_max_ms)


def validate_token_fields(
    name: str, role: str, tenant: str | None, tenants: Sequence[str] = ()
) -> str | None:
    """Why an API token with these fields is invalid, or None (the API before logging,
    apply as the authority)."""
    if role not in TOKEN_ROLES:
        return "role must be 'tenant', 'admin' or 'worker'"
    if (role == "tenant") != (tenant is not None):
        return "a tenant token names its tenant; admin and worker tokens take none"
    if tenant is not None and not NAME_RE.match(tenant):
        return f"tenant name {tenant!r} is not valid"
    if tenants and role != "worker":
        return "only a worker token takes a tenants list"
    if len(tenants) > MAX_TOKEN_TENANTS:
        return f"a worker token names at most {MAX_TOKEN_TENANTS} tenants"
    for served in tenants:
        if not NAME_RE.match(served):
            return f"tenant name {served!r} is not valid"
    if len(set(tenants)) != len(tenants):
        return "a worker token names each tenant once"
    if not 0 < len(name) <= MAX_TOKEN_NAME_CHARS:
        return f"a token name must hold 1 to {MAX_TOKEN_NAME_CHARS} characters"
    return None


def validate_idempotency_key(key: str) -> str | None:
    """Why this idempotency key is invalid, or None."""
    if not IDEMPOTENCY_KEY_RE.fullmatch(key):
        return "idempotency key must be 1-128 printable ASCII characters"
    return None


def validate_limits(patch: e.TenantLimitsPatch) -> str | None:
    if patch.max_waiting is not None and patch.max_waiting < 0:
        return "max_waiting must be >= 0 (0: unlimited)"
    if patch.max_running is not None and patch.max_running < 0:
        return "max_running must be >= 0 (0: unlimited)"
    if patch.weight is not None and not (math.isfinite(patch.weight) and patch.weight > 0):
        return "weight must be a finite number > 0"
    rate = patch.submit_rate
    if rate is not None and not (math.isfinite(rate) and 0 <= rate <= MAX_SUBMIT_RATE):
        return f"submit_rate must be between 0 (unlimited) and {MAX_SUBMIT_RATE:g} tasks/s"
    if patch.submit_burst is not None and not 0 <= patch.submit_burst <= MAX_SUBMIT_RATE:
        return f"submit_burst must be between 0 (one second's worth) and {MAX_SUBMIT_RATE:g}"
    return None


#: The parameters of the built-in task types the workers run (clients/worker/task_api.py):
#: a key outside these is refused at submit, so a misspelt one (``secs``) is not silently
#: ignored by the task. ``noop`` takes any params: callers carry payloads in them.
BUILTIN_PARAMS: Final[Mapping[str, tuple[str, ...]]] = {
    "sleep": ("seconds",),
    "fail": ("message",),
    "spark.sql": ("query", "max_rows"),
}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def validate_builtin_params(type_name: str, params: bytes) -> str | None:
    """Why ``params`` (JSON text) do not fit the built-in task type ``type_name``, or None
    (None too for any other type: only its code knows its params)."""
    allowed = BUILTIN_PARAMS.get(type_name)
    if allowed is None:
        return None
    try:
        value = json.loads(params)
    except ValueError:
        return None  # not JSON: the request's decoding answers that
    if value is None:
        value = {}
    keys = ", ".join(allowed)
    if not isinstance(value, dict):
        return f"{type_name} params must be a JSON object with keys {keys}"
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        return (
            f"{type_name} params: unknown key {', '.join(map(repr, unknown))}; "
            f"allowed keys: {keys} (docs/TASKS.md)"
        )
    seconds = value.get("seconds", 0)
    if type_name == "sleep" and not (_is_number(seconds) and 0 <= seconds < math.inf):
        return f"sleep params: seconds must be a number >= 0, got {seconds!r}"
    if type_name == "spark.sql":
        query = value.get("query")
        if not isinstance(query, str) or not query.strip():
            return "spark.sql params: query (a non-empty SQL string) is required"
        max_rows = value.get("max_rows", 0)
        if not (_is_number(max_rows) and isinstance(max_rows, int) and max_rows >= 0):
            return f"spark.sql params: max_rows must be an integer >= 0, got {max_rows!r}"
    return None


def unknown_type_problem(
    type_name: str, code: str | None, tenant: str, served: bool | None
) -> str | None:
    """Why a task of ``type_name`` for ``tenant`` would not run, or None; ``served`` is
    whether a worker serving the tenant ever listed the type (None: the cluster cannot tell,
    StateMachine.type_served). A ``module:function`` type is imported from its code
    artifact, and no worker imports one from anywhere else
    (clients/worker/runtime/process_runs.py, clients/worker/runtime/thread_runs.py) unless it
    registered that very name; a plain name runs only on a worker that registered it
    (docs/DESIGN.md §6, "Served task types"). Checked at submit unless the caller sends
    ``allow_unknown_type`` (docs/API.md, "Task types")."""
    if code is not None or served:
        return None
    if ":" in type_name:
        return (
            f"task type {type_name!r} is module:function, imported from a code artifact:"
            " upload the module (steward code upload FILE) and submit with its code (--code"
            " SHA256); for a type an embedded worker registered under this name, send"
            " allow_unknown_type"
        )
    if served is None:
        return None
    # Says nothing of what other tenants' workers serve: the same words either way.
    return (
        f"task type {type_name!r} is not served: no worker serving tenant {tenant!r} has"
        " registered it (a typo? built-in types: noop, sleep, fail, spark.sql); start a"
        " worker that registers it, or send allow_unknown_type (steward submit"
        " --allow-unknown-type) to submit it anyway, for a worker that will"
    )
