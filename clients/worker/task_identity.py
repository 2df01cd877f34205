"""Which uid runs a tenant's task processes (docs/SECURITY.md, "Task processes").

A worker running as root never runs tenant code as root unless told so explicitly:

- ``tenant_users`` (``--tenant-user alice=svc_alice``) names a user for one tenant;
- else ``task_user`` (``--task-user USER``) one user for every tenant;
- else each tenant gets a uid of its own from ``task_uid_range`` (like systemd's
  ``DynamicUser``: no ``/etc/passwd`` entry needed; gid = uid, no supplementary groups),
  chosen by a stable hash of the tenant's name and probed past uids this worker has
  already given to other tenants, so tenants never share one here.

User 0 (``root``) is refused unless ``allow_root_tasks``. A worker that is not root cannot
switch users: its tasks run under its own uid (the default, logged as a warning) and
naming any other user is an error.
"""

from __future__ import annotations

import logging
import os
import pwd
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

logger = logging.getLogger("clients.worker.task_processes")

#: systemd's DynamicUser range (docs: "61184-65519"), unlikely to hold real accounts.
DEFAULT_TASK_UID_RANGE: Final = (61184, 65519)


class TaskUserError(ValueError):
    """A task user that cannot be used (unknown, root without opt-in, not switchable)."""


@dataclass(frozen=True)
class TaskIdentity:
    """The uid/gid a task process runs under; ``switch`` False: the worker's own."""

    uid: int
    gid: int
    switch: bool


def resolve_user(name: str) -> tuple[int, int]:
    """``USER`` or a numeric ``UID`` -> (uid, gid); a bare uid gets gid = uid."""
    if name.isdigit():
        uid = int(name)
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except KeyError:
            return uid, uid
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise TaskUserError(f"unknown task user {name!r} (no such user on this host)") from None
    return entry.pw_uid, entry.pw_gid


class TaskIdentities:
    """Maps tenants to the identity their task processes run under. Thread-safe."""

    def __init__(
        self,
        *,
        task_user: str | None = None,
        tenant_users: Mapping[str, str] | None = None,
        uid_range: tuple[int, int] = DEFAULT_TASK_UID_RANGE,
        allow_root: bool = False,
        worker_uid: int | None = None,
    ) -> None:
        self.worker_uid = os.geteuid() if worker_uid is None else worker_uid
        self.is_root = self.worker_uid == 0
        low, high = uid_range
        if not 0 < low <= high:
            raise TaskUserError(f"bad task uid range {low}-{high}: need 0 < LOW <= HIGH")
        self.uid_range = (low, high)
        self.allow_root = allow_root
        self._fixed = self._check(task_user) if task_user is not None else None
        self._per_tenant = {
            tenant: self._check(user) for tenant, user in (tenant_users or {}).items()
        }
        self._dynamic: dict[str, int] = {}
        self._taken: set[int] = set()
        self._lock = threading.Lock()
        if not self.is_root and self._fixed is None and not self._per_tenant:
            logger.warning(
                "the worker is not root, so task processes run under its own uid %d: tenants"
                " are separated by process, not by user (see docs/SECURITY.md)",
                self.worker_uid,
            )
        elif self._fixed is not None and self._fixed.uid == 0:
            logger.warning("!!! tenant code runs AS ROOT on this worker (--allow-root-tasks) !!!")

    def _check(self, user: str) -> TaskIdentity:
        uid, gid = resolve_user(user)
        if uid == self.worker_uid:
            if uid == 0 and not self.allow_root:
                raise TaskUserError(
                    "refusing to run tenant code as root: name another --task-user, or add"
                    " --allow-root-tasks if every tenant is trusted"
                )
            return TaskIdentity(uid, gid, switch=False)
        if not self.is_root:
            raise TaskUserError(
                f"task user {user!r}: only a worker running as root can run tasks as another"
                " user; leave --task-user out to run them under the worker's own uid"
            )
        return TaskIdentity(uid, gid, switch=True)

    def for_tenant(self, tenant: str) -> TaskIdentity:
        named = self._per_tenant.get(tenant) or self._fixed
        if named is not None:
            return named
        if not self.is_root:
            return TaskIdentity(self.worker_uid, os.getegid(), switch=False)
        with self._lock:
            uid = self._dynamic.get(tenant)
            if uid is None:
                uid = self._allocate(tenant)
        return TaskIdentity(uid, uid, switch=True)

    def _allocate(self, tenant: str) -> int:
        low, high = self.uid_range
        size = high - low + 1
        if len(self._taken) >= size:
            raise TaskUserError(
                f"the task uid range {low}-{high} is used up ({size} tenants on this worker)"
            )
        start = zlib.crc32(tenant.encode()) % size
        for step in range(size):
            uid = low + (start + step) % size
            if uid not in self._taken:
                self._taken.add(uid)
                self._dynamic[tenant] = uid
                return uid
        raise AssertionError("unreachable: a free uid was counted")
