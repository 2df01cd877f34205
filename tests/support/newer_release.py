"""``python -m tests.support.newer_release broker ...``: today's ``steward`` posing as the next
release, for the mixed-version test of tests/integration/test_boot_rules.py. It reads entry
format ``ENTRY_FORMAT_VERSION + 1`` and writes its submit entries in it (what a release whose
submit gained a field older brokers cannot apply would do); every other entry stays in the
oldest format that holds it, as today's code writes them."""

from __future__ import annotations

import sys

import msgspec

from broker.core import entries as e

NEWER = e.ENTRY_FORMAT_VERSION + 1
_encode = e.encode_entry


def _encode_newer(entry: e.Entry | e.Confirm) -> bytes:
    if isinstance(entry, e.SubmitTasks):
        entry = msgspec.structs.replace(entry, v=NEWER)
    return _encode(entry)


def main() -> int:
    # The module's globals, as the leader and the decoder read them at call time.
    vars(e)["ENTRY_FORMAT_VERSION"] = NEWER
    vars(e)["encode_entry"] = _encode_newer
    from clients.cli import main as steward

    return steward(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
