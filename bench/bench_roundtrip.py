"""Submit-to-result round trip of one no-op task, closed loop, one client: round trips only.

The same systems, settings and calls as ``bench/bench_e2e.py`` (which also measures
them, in its table's round trip column), without the throughput runs: for each system,
submit one no-op task and wait for its result the way its docs show, repeat; p50 / p99
in the table. Steward: ``client.submit("noop", ...).result(timeout=...)`` through the
public ``StewardClient``; Dramatiq ``send().get_result(block=True)``; Celery
``delay().get()``; RQ ``enqueue().latest_result(timeout=...)``.

    python bench/bench_roundtrip.py                          # every installed system
    python bench/bench_roundtrip.py --systems steward --n 5000
    python bench/bench_roundtrip.py --systems steward --profile /tmp/rt-prof  # + py-spy

Every option of bench_e2e.py applies (``--round-trips`` is also ``--n``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_e2e import main

if __name__ == "__main__":
    # A small warm-up (start-up, first connections); later options win over these.
    main(["--modes", "none", "--warmup", "100", "--round-trips", "2000", *sys.argv[1:]])
