"""Whether a new task may be created: the one admission rule for a new task's spec
(docs/DESIGN.md §6, "Fit and admission").

Every way a task comes to be asks :func:`admission_problem` before the leader logs it: a
submit over HTTP (broker/api/handlers_tasks.py), a schedule's template when the schedule
is created (broker/api/handlers_schedules.py; its firings copy the template) and the
children a finish report spawns (broker/workers/finish_reports.py). Each caller adds only
what is its own: who the caller acts for (a token's tenant, a parent's tenant under
isolation), transactions, a spawn's anchors. ``apply`` stays the authority on what needs
the state at apply time (broker/core/validation.py ``validate_task_spec`` again, unknown
artifacts, dependencies).

Spawned children are checked like a submit, built-in params included: their spec comes
from the parent task's code, which is tenant code and so as untrusted as a request; a
child whose built-in params are wrong would only fail on a worker later, so its parent
fails now with the reason instead (the API answers the same mistake with a 400).

Two checks are the caller's choice, and why:

- whether a worker serving the tenant registered the type (``check_served_type``): a
  courtesy to a person submitting, who can resend with ``allow_unknown_type``; a schedule
  firing or a spawned child has nobody to answer, and the parent's code knows what its
  workers run;
- whether the code artifact must already exist (``code_must_exist``): a schedule's
  template is not checked again when it fires, so it must name an artifact now; a submit
  or a spawn is refused by ``apply`` (per task, naming it) when its artifact is unknown.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

import msgspec

from broker.core import entries as e
from broker.core.state import StateMachine
from broker.core.validation import (
    unknown_type_problem,
    validate_builtin_params,
    validate_task_spec,
)

#: The largest params (JSON text) of a task, by default (``ApiConfig.max_params_bytes``).
MAX_PARAMS_BYTES: Final = 64 * 1024


class Refusal(enum.Enum):
    """What kind of problem keeps a task from being created (the API's status for it)."""

    INVALID = "invalid"  # 400 invalid_request
    TOO_LARGE = "too_large"  # 413 too_large
    UNKNOWN_CODE = "unknown_code"  # 404 not_found: unknown, or not the tenant's to use


@dataclass(frozen=True, slots=True)
class Inadmissible:
    refusal: Refusal
    message: str  # says what is wrong, without the caller's prefix ("tasks[2]: ")


def admission_problem(
    state: StateMachine,
    spec: e.TaskSpec,
    *,
    max_params_bytes: int = MAX_PARAMS_BYTES,
    code_owners_enforced: bool,
    check_served_type: bool = False,
    code_must_exist: bool = False,
) -> Inadmissible | None:
    """Why a task with ``spec`` (its tenant already the one it acts for) may not be
    created, or None.

    ``code_owners_enforced``: tenants are isolated (authentication on), so a task may run
    only code its tenant uploaded or that is shared (an artifact without owners)."""
    if len(spec.params) > max_params_bytes:
        return Inadmissible(Refusal.TOO_LARGE, f"params over {max_params_bytes} bytes")
    try:
        # JSON as the API's request decoding takes it (numbers kept as text, any size).
        msgspec.json.decode(spec.params, type=msgspec.Raw)
    except msgspec.DecodeError:
        return Inadmissible(Refusal.INVALID, "params are not JSON")
    problem = validate_task_spec(spec) or validate_builtin_params(spec.type, spec.params)
    if problem is None and check_served_type:
        served = state.type_served(spec.tenant, spec.type)
        problem = unknown_type_problem(spec.type, spec.code, spec.tenant, served)
    if problem is not None:
        return Inadmissible(Refusal.INVALID, problem)
    if spec.code is not None:
        artifact = state.artifacts.get(spec.code)
        if artifact is None:
            unusable = code_must_exist
        else:
            owners = artifact.owners
            unusable = code_owners_enforced and bool(owners) and spec.tenant not in owners
        if unusable:
            return Inadmissible(
                Refusal.UNKNOWN_CODE, f"code artifact {spec.code} was never uploaded"
            )
    return None
