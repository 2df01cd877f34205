"""A temporary directory per test process (``TMPDIR``), and the one they all share.

Two pytest-xdist processes run real-process tests at once (``tests/conftest.py``, the two
lanes). Names derived from ``tempfile.gettempdir()`` with nothing random in them, such as a
worker's default work dir (``clients/worker/config.py``: its id in the name), must not
collide between them. So each test process gets a directory of its own as ``TMPDIR``
(inherited by every process a test starts), made like ``/tmp`` (``1777``: task users create
their files there too). What test processes must share, the port locks
(``tests/support/reserved_ports.py``), lives under :func:`shared_tmpdir`, the machine's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Final

#: The machine's temporary directory, as the first test process found it.
SHARED_TMPDIR_ENV: Final = "STEWARD_TEST_SHARED_TMPDIR"


def shared_tmpdir() -> Path:
    """The temporary directory every test process here shares."""
    return Path(os.environ.get(SHARED_TMPDIR_ENV) or tempfile.gettempdir())


def use_own_tmpdir(process_name: str) -> Path:
    """Make ``TMPDIR`` (this process's and its children's) a directory of this process's."""
    shared = shared_tmpdir()
    os.environ[SHARED_TMPDIR_ENV] = str(shared)
    own = shared / f"steward-tests-{os.geteuid()}-{process_name}"
    own.mkdir(exist_ok=True)
    if own.is_symlink() or own.stat().st_uid != os.geteuid():
        raise RuntimeError(f"{own} is not this user's own directory: remove it")
    os.chmod(own, 0o1777)
    os.environ["TMPDIR"] = str(own)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return own
