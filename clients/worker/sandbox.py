"""Process hardening for the worker and its task processes (Linux ``prctl``).

- Non-dumpable (``PR_SET_DUMPABLE`` 0): other processes of the same uid can neither
  ptrace the process nor read its ``/proc/<pid>/{mem,environ,maps,...}`` (the kernel
  makes those files root's). The worker sets it on itself so a task process running under
  the worker's own uid cannot read the worker's memory or environment; every task process
  sets it so another tenant's process under the same uid cannot read it.
- No new privileges (``PR_SET_NO_NEW_PRIVS``): a task process cannot gain privileges
  through a setuid binary (``sudo``, ``su``) after it starts.

Elsewhere than Linux these are no-ops that say so (``False``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Final

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG: Final = 1  # from <linux/prctl.h>
_PR_SET_DUMPABLE: Final = 4
_PR_GET_DUMPABLE: Final = 3
_PR_SET_NO_NEW_PRIVS: Final = 38
_PR_GET_NO_NEW_PRIVS: Final = 39


def _load_prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL: Final = _load_prctl()


def _call(option: int, value: int) -> bool:
    if _PRCTL is None:
        return False
    if _PRCTL(option, value, 0, 0, 0) != 0:
        logger.warning("prctl(%d, %d) failed: errno %d", option, value, ctypes.get_errno())
        return False
    return True


def make_non_dumpable() -> bool:
    """Forbid ptrace and /proc reads of this process by others of its uid."""
    return _call(_PR_SET_DUMPABLE, 0)


def forbid_new_privileges() -> bool:
    """setuid binaries run by this process (and its children) gain nothing."""
    return _call(_PR_SET_NO_NEW_PRIVS, 1)


def set_parent_death_signal(signum: int) -> None:
    """Ask Linux for ``signum`` when the parent thread goes away (no-op elsewhere).

    Logs nothing, so it is safe in a forked child before exec.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def die_with_parent(parent_pid: int) -> bool:
    """SIGKILL this process when its parent (the worker) dies; exit now if it already did.

    A task must not outlive the worker that would report it (a kill -9 of the worker
    must end its tasks, as the broker re-runs them elsewhere).
    """
    if not _call(_PR_SET_PDEATHSIG, int(signal.SIGKILL)):
        return False
    if os.getppid() != parent_pid:  # it died before the prctl took effect
        os._exit(1)
    return True


def is_dumpable() -> bool | None:
    """This process's dumpable flag; None where it cannot be read."""
    if _PRCTL is None:
        return None
    return bool(_PRCTL(_PR_GET_DUMPABLE, 0, 0, 0, 0))
