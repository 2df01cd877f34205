"""The standalone broker's worker restarts back off while a worker keeps exiting soon after
its start, and start over after a steady run (broker/server/child_workers.py)."""

from broker.server.child_workers import (
    FIRST_RESTART_DELAY_S,
    MAX_RESTART_DELAY_S,
    STEADY_RUN_S,
    restart_delay_s,
)


def test_restarts_back_off_while_a_worker_exits_at_once_and_start_over_after_a_steady_run() -> None:
    delays = []
    delay = None
    for _ in range(8):
        delay = restart_delay_s(delay, ran_s=0.5)
        delays.append(delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert delays[0] == FIRST_RESTART_DELAY_S and delays[-1] == MAX_RESTART_DELAY_S
    assert restart_delay_s(30.0, ran_s=STEADY_RUN_S) == FIRST_RESTART_DELAY_S
