"""The per-tenant submit rate limit: the token bucket (broker/api/rate_limit.py), the
tenant's replicated setting and the leader's 429 before logging (in process)."""

from __future__ import annotations

import math

import pytest

from broker.api.rate_limit import SubmitRateLimiter
from broker.core import ErrorCode, StateMachine, Tenant
from broker.core import entries as e
from tests.support.http_api import TASKS, Api
from tests.support.machine import Machine, code


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_the_burst_then_the_rate() -> None:
    clock = FakeClock()
    limiter = SubmitRateLimiter(clock)
    assert [limiter.take("t", 2.0, 3, 1) for _ in range(3)] == [None, None, None]
    assert limiter.take("t", 2.0, 3, 1) == pytest.approx(0.5)
    clock.now += 0.5
    assert limiter.take("t", 2.0, 3, 1) is None
    clock.now += 10  # refills up to the burst only
    assert limiter.take("t", 2.0, 3, 3) is None
    assert limiter.take("t", 2.0, 3, 2) == pytest.approx(1.0)
    assert limiter.take("t", 2.0, 3, 4) == math.inf  # never fits: over the burst
    assert limiter.take("other", 2.0, 3, 3) is None  # per tenant
    assert limiter.take("t", 0.0, 0, 1000) is None  # 0: unlimited
    assert SubmitRateLimiter.capacity(0.5, 0) == 1.0 and SubmitRateLimiter.capacity(7.2, 0) == 8


def test_the_setting_is_replicated_state_and_validated() -> None:
    m = Machine()
    patch = e.TenantLimitsPatch(submit_rate=5.5, submit_burst=20)
    tenant = m.apply(e.SetTenant(time_ms=m.now, tenant="t", limits=patch, v=3))
    assert isinstance(tenant, Tenant) and (tenant.submit_rate, tenant.submit_burst) == (5.5, 20)
    copy = StateMachine.from_snapshot(m.m.encode_snapshot())
    assert copy.tenants["t"].submit_rate == 5.5 and copy.digest() == m.m.digest()
    # Fields left out keep their value.
    m.apply(e.SetTenant(time_ms=m.now, tenant="t", limits=e.TenantLimitsPatch(weight=2)))
    assert m.m.tenants["t"].submit_burst == 20
    for bad in (
        e.TenantLimitsPatch(submit_rate=-1),
        e.TenantLimitsPatch(submit_rate=math.inf),
        e.TenantLimitsPatch(submit_burst=-3),
    ):
        assert code(m.apply(e.SetTenant(time_ms=m.now, tenant="t", limits=bad))) is (
            ErrorCode.INVALID
        )


async def test_over_the_rate_is_429_with_retry_after_and_nothing_logged(api: Api) -> None:
    response = await api.put("/api/v1/tenants/slow", json={"submit_rate": 0.2, "submit_burst": 2})
    assert response.status_code == 200, response.text
    assert response.json()["submit_rate"] == 0.2 and response.json()["submit_burst"] == 2
    for _ in range(2):
        assert (await api.post(TASKS, json={"type": "a", "tenant": "slow"})).status_code == 201
    applied = api.node.state.entries_applied
    refused = await api.post(TASKS, json={"type": "a", "tenant": "slow"})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limited"
    assert refused.json()["error"].get("retryable", False) is False  # not a failover
    assert 1 <= int(refused.headers["retry-after"]) <= 5
    assert api.node.state.entries_applied == applied  # refused before logging
    # Other tenants are not limited; a batch over the burst can never pass: 400.
    assert (await api.post(TASKS, json={"type": "a", "tenant": "fast"})).status_code == 201
    batch = {"tasks": [{"type": "a", "tenant": "slow"}] * 3}
    too_big = await api.post(TASKS, json=batch)
    assert too_big.status_code == 400 and "submit burst" in too_big.text
    # 0 lifts the limit.
    await api.put("/api/v1/tenants/slow", json={"submit_rate": 0})
    assert (await api.post(TASKS, json=batch)).status_code == 200


async def test_bad_rate_settings_are_400(api: Api) -> None:
    for body in ({"submit_rate": -1}, {"submit_burst": -1}, {"submit_rate": 1e9}):
        response = await api.put("/api/v1/tenants/x", json=body)
        assert response.status_code == 400, response.text
