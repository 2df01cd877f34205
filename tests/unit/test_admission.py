"""The admission rule for a new task (broker/core/admission.py, docs/DESIGN.md §6 "Fit and
admission"): one function asked by a submit over HTTP, a schedule's template and the
children a finish report spawns. Spawned children are tenant input like a request, so a
child with bad built-in params is refused with the very words a submit gets."""

from __future__ import annotations

import pytest

from broker.core import StateMachine, TaskState
from broker.core import entries as e
from broker.core.admission import MAX_PARAMS_BYTES, Inadmissible, Refusal, admission_problem
from tests.support.http_api import TASKS, Api, error_of
from tests.support.link_broker import Broker
from wire import worker_protocol as p

SHA = "a" * 64
BAD_SLEEP = b'{"seconds": -1}'
BAD_SLEEP_WORDS = "sleep params: seconds must be a number >= 0, got -1"


def _state_with_code(owner: str | None) -> StateMachine:
    state = StateMachine()
    state.apply(e.AddCode(time_ms=1, sha256=SHA, name="m.py", size_bytes=1, tenant=owner or ""))
    return state


def _spec(**fields: object) -> e.TaskSpec:
    values: dict[str, object] = {"id": 0, "type": "noop", "tenant": "t"}
    values.update(fields)
    return e.TaskSpec(**values)  # type: ignore[arg-type]


def _problem(state: StateMachine, spec: e.TaskSpec, **options: bool) -> Inadmissible | None:
    options.setdefault("code_owners_enforced", False)
    return admission_problem(state, spec, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "refusal", "words"),
    [
        (_spec(params=b"1" * (MAX_PARAMS_BYTES + 1)), Refusal.TOO_LARGE, "params over 65536"),
        (_spec(params=b"{nope"), Refusal.INVALID, "params are not JSON"),
        (_spec(type="bad type"), Refusal.INVALID, "type must be"),
        (_spec(max_attempts=0), Refusal.INVALID, "max_attempts must be"),
        (_spec(type="sleep", params=BAD_SLEEP), Refusal.INVALID, BAD_SLEEP_WORDS),
        (_spec(type="spark.sql", params=b"{}"), Refusal.INVALID, "query (a non-empty SQL"),
    ],
)
def test_a_bad_spec_is_refused_with_its_kind_and_words(
    spec: e.TaskSpec, refusal: Refusal, words: str
) -> None:
    problem = _problem(StateMachine(), spec)
    assert problem is not None and problem.refusal is refusal
    assert words in problem.message


def test_a_good_spec_is_admitted() -> None:
    state = StateMachine()
    assert _problem(state, _spec(params=b"1" * MAX_PARAMS_BYTES)) is None
    assert _problem(state, _spec(type="sleep", params=b'{"seconds": 0.5}')) is None


def test_the_params_limit_is_the_callers_setting() -> None:
    spec = _spec(params=b"[" + b"1," * 600 + b"1]")
    problem = admission_problem(
        StateMachine(), spec, max_params_bytes=1024, code_owners_enforced=False
    )
    assert problem == Inadmissible(Refusal.TOO_LARGE, "params over 1024 bytes")


def test_code_of_another_tenant_is_refused_only_when_tenants_are_isolated() -> None:
    state = _state_with_code("other")
    spec = _spec(code=SHA)
    assert _problem(state, spec) is None
    refused = _problem(state, spec, code_owners_enforced=True)
    assert refused == Inadmissible(Refusal.UNKNOWN_CODE, f"code artifact {SHA} was never uploaded")
    assert _problem(state, _spec(code=SHA, tenant="other"), code_owners_enforced=True) is None
    # A shared artifact (no owners) is every tenant's.
    assert _problem(_state_with_code(None), spec, code_owners_enforced=True) is None


def test_unknown_code_is_refused_only_where_the_caller_needs_it_now() -> None:
    spec = _spec(code=SHA)
    assert _problem(StateMachine(), spec) is None  # apply names it, per task
    problem = _problem(StateMachine(), spec, code_must_exist=True)
    assert problem is not None and problem.refusal is Refusal.UNKNOWN_CODE


def test_the_served_type_check_is_asked_for() -> None:
    spec = _spec(type="mod:run")
    assert _problem(StateMachine(), spec) is None
    problem = _problem(StateMachine(), spec, check_served_type=True)
    assert problem is not None and "module:function" in problem.message


async def test_a_spawned_child_with_bad_params_is_refused_as_a_submit_is(
    api: Api, broker: Broker
) -> None:
    # Over HTTP: 400, the admission rule's words.
    response = await api.post(TASKS, json={"type": "sleep", "params": {"seconds": -1}})
    assert error_of(response, 400, "invalid_request") == BAD_SLEEP_WORDS
    # Spawned by a task: the same words fail the parent, and no child is created.
    worker = broker.worker()
    await worker.hello()
    [root] = await broker.submit(track_tree=True)
    await worker.expect(p.Assign)
    spawn = (p.SpawnRequest(type="sleep", params=BAD_SLEEP),)
    worker.finish(p.TaskReport(task_id=root, attempt=1, ok=True, spawn=spawn))
    await worker.expect(p.FinishAck)
    parent = broker.task(root)
    assert parent.state == TaskState.ERROR
    assert parent.error is not None
    assert parent.error.startswith(f"invalid spawn #0 (type 'sleep'): {BAD_SLEEP_WORDS}")
    assert list(broker.node.state.tasks) == [root]
