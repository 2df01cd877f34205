"""The tree views (broker/api/handlers_trees.py) over the state machine, and their routes
in process: GET /api/v1/trees/{root} and GET /api/v1/trees; the tree metrics."""

from __future__ import annotations

import pytest

from broker.api.handlers_trees import TIMED_OUT_REASON, list_trees, tree_detail, view_state
from broker.core import ApplyResult, StateMachine
from broker.core import entries as e
from broker.observability.metrics import BrokerMetrics
from tests.support.http_api import Api, error_of, run_and_finish, submit
from tests.support.machine import Trees

TREES = "/api/v1/trees"


def test_detail_counts_tasks_by_state_and_lists_pending_anchors() -> None:
    m = Trees()
    root = m.root(tree_timeout_ms=5_000)
    created_ms = m.m.tasks[root].created_ms
    a, b = m.done(root, m.child(root), m.child(root))
    m.run(a)
    view = tree_detail(m.m, m.tree(root), created_ms + 1_500)
    assert view.state == "pending" and view.attempt == 1 and view.timeout_s == 5.0
    assert view.tasks["finished"] == 1 and view.tasks["running"] == 1
    assert view.tasks["waiting"] == 1 and sum(view.tasks.values()) == 3
    assert view.pending_anchors == [a, b] and view.pending_count == 2
    assert view.age_s == 1.5 and view.deadline is not None and view.ended_at is None
    m.done(a)
    m.done(b)
    done = tree_detail(m.m, m.tree(root), created_ms + 10**9)
    assert done.state == "completed" and done.pending_anchors == [] and done.pending_count == 0
    assert done.tasks["finished"] == 3 and done.ended_at is not None and done.deadline is None
    # An ended tree's age is its duration: it no longer grows.
    assert done.age_s == (m.tree(root).ended_ms or 0) / 1000 - created_ms / 1000


def test_timed_out_is_told_apart_from_failed() -> None:
    m = Trees()
    timed = m.root(tree_timeout_ms=1_000)
    m.run(timed)
    m.tick(2_000)
    assert m.tree(timed).reason == TIMED_OUT_REASON  # the state machine's own words
    assert view_state(m.tree(timed)) == "timed_out"
    failed = m.root()
    (child,) = m.done(failed, m.child(failed))
    m.fail(child)
    assert view_state(m.tree(failed)) == "failed"
    assert tree_detail(m.m, m.tree(failed), 0).reason == f"task {child} ended in error"
    pending = m.root()

    def roots(state: str | None, **kw: int) -> list[int]:
        found = list_trees(m.m, tree_state=state, tenant=None, after=kw.get("after", 0),
                           limit=kw.get("limit", 10))  # fmt: skip
        return [t.root for t in found]

    assert roots("timed_out") == [timed] and roots("failed") == [failed]
    assert roots("pending") == [pending] and roots("completed") == []
    assert roots(None) == [timed, failed, pending]
    assert roots(None, limit=2) == [timed, failed] and roots(None, after=failed) == [pending]
    assert list_trees(m.m, tree_state=None, tenant="other", after=0, limit=10) == []


def test_members_index_follows_purges_and_snapshots() -> None:
    m = Trees()
    root = m.root()
    (child,) = m.done(root, m.child(root))
    assert m.m.tree_members == {root: {root, child}}
    reloaded = StateMachine.from_snapshot(m.m.encode_snapshot())
    assert reloaded.tree_members == m.m.tree_members
    m.done(child)
    m.tick(m.m.config.finished_task_retention_ms + 1)
    assert m.m.tree_members == {} and m.m.tree(root) is None
    m.m.check_invariants()


class _Observed(Trees):
    """Trees whose every entry the leader's metrics observe, as the leader's write path does."""

    def __init__(self, metrics: BrokerMetrics) -> None:
        self.metrics = metrics
        super().__init__()

    def apply(self, entry: e.Entry) -> ApplyResult:
        applied = self.m.apply(entry)
        self.effects.extend(applied.effects)
        self.metrics.observe_applied(entry, applied, self.m)
        return applied.result


def test_metrics_count_trees_started_and_ended() -> None:
    metrics = BrokerMetrics()
    m = _Observed(metrics)
    ok = m.root()
    m.done(ok)
    timed = m.root(tree_timeout_ms=1_000)
    m.run(timed)
    m.tick(2_000)
    bad = m.root()
    m.fail(bad)
    m.root()  # pending
    metrics.bind(lambda: m.m, lambda: "leader", lambda: (1, 1))
    text = metrics.render().decode()
    assert 'steward_trees_started_total{tenant="t"} 4.0' in text
    assert 'steward_trees_completed_total{tenant="t"} 1.0' in text
    assert 'steward_trees_timed_out_total{tenant="t"} 1.0' in text
    assert 'steward_trees_failed_total{tenant="t"} 1.0' in text
    assert 'steward_trees_pending{tenant="t"} 1.0' in text
    assert "steward_tree_completion_seconds_count 1.0" in text


# --- the routes, in process ---------------------------------------------------------------


async def test_tree_route_shows_a_tree_and_404s_otherwise(api: Api) -> None:
    root = (await submit(api, track_tree=True, tree_timeout_s=12.5))["id"]
    plain = (await submit(api))["id"]
    [child] = await run_and_finish(api.node, root, "child")
    response = await api.get(f"{TREES}/{root}")
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["root"] == root and view["state"] == "pending" and view["timeout_s"] == 12.5
    assert view["pending_anchors"] == [child] and view["pending_count"] == 1
    assert view["tasks"]["finished"] == 1 and view["tasks"]["waiting"] == 1
    assert view["tenant"] == "default" and view["age_s"] >= 0
    for missing in (plain, 10**9):
        error_of(await api.get(f"{TREES}/{missing}"), 404, "not_found")
    error_of(await api.get(f"{TREES}/{root}", params={"x": "1"}), 400, "invalid_request")


async def test_trees_route_filters_and_pages(api: Api) -> None:
    roots = [(await submit(api, track_tree=True))["id"] for _ in range(3)]
    await run_and_finish(api.node, roots[0])
    listed = (await api.get(TREES, params={"state": "pending"})).json()
    assert [t["root"] for t in listed["trees"]] == roots[1:] and listed["next_after"] is None
    done = (await api.get(TREES, params={"state": "completed"})).json()
    assert [t["root"] for t in done["trees"]] == roots[:1]
    page = (await api.get(TREES, params={"limit": 2})).json()
    assert [t["root"] for t in page["trees"]] == roots[:2] and page["next_after"] == roots[1]
    rest = (await api.get(TREES, params={"after": roots[1]})).json()
    assert [t["root"] for t in rest["trees"]] == roots[2:]


@pytest.mark.parametrize(
    "params", [{"state": "running"}, {"limit": "0"}, {"after": "x"}, {"sort": "root"}]
)
async def test_trees_route_refuses_bad_queries(api: Api, params: dict[str, str]) -> None:
    error_of(await api.get(TREES, params=params), 400, "invalid_request")
