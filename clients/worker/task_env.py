"""Where task processes live: their environment, users' passwd view, and directories.

``scrubbed_env`` is everything a task process inherits from the worker (nothing secret).
A uid from the dynamic range has no ``/etc/passwd`` entry, which the JVM (Spark's
``user.home``, Hadoop's login) cannot do without: when Debian's ``libnss-wrapper`` is
installed, the process gets a one-line passwd and group file of its own through
``LD_PRELOAD`` (as OpenShift does for arbitrary uids); without it, plain Python tasks run
and a JVM started by a task fails (the worker warns at start).

The work area's layout and modes: docs/SECURITY.md, "Task processes".
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import pwd
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import clients
from clients.worker.task_identity import TaskIdentity

logger = logging.getLogger("clients.worker.task_processes")

#: Variables a task process inherits from the worker; nothing else (no credentials).
PASSED_ENV: Final = ("PATH", "LANG", "LC_ALL", "TZ", "JAVA_HOME", "SPARK_HOME")
PROJECT_ROOT: Final = Path(clients.__file__).resolve().parent.parent
_NSS_WRAPPER_GLOBS: Final = (
    "/usr/lib/*-linux-gnu/libnss_wrapper.so",
    "/usr/lib64/libnss_wrapper.so",
    "/usr/lib/libnss_wrapper.so",
)


class TaskProcessError(Exception):
    """A task process could not be started (its task fails with this message)."""


class WorkDirInUseError(Exception):
    """Another live worker holds the work directory's lock (the message names it)."""


#: In the work directory; a worker holds an flock on it while it runs.
WORK_DIR_LOCK: Final = "worker.lock"
_LOCK_POLL_S: Final = 0.1


def nss_wrapper_library() -> str | None:
    """libnss_wrapper.so's path, or None where it is not installed."""
    for pattern in _NSS_WRAPPER_GLOBS:
        for path in sorted(glob.glob(pattern)):
            return path
    return None


def has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def jvm_user_name_problem(uid: int) -> str | None:
    """Why a JVM started under ``uid`` would fail, or None: Java and Hadoop look the user's
    name and home up, and a uid with no passwd entry gets them only from libnss-wrapper."""
    if has_passwd_entry(uid) or nss_wrapper_library() is not None:
        return None
    return f"uid {uid} has no passwd entry and libnss-wrapper is not installed to give it one"


def scrubbed_env(
    home: Path, identity: TaskIdentity | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of a task process (docs/SECURITY.md, \"Task processes\")."""
    source = os.environ if base is None else base
    env = {name: source[name] for name in PASSED_ENV if name in source}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(
        {
            "HOME": str(home),
            "TMPDIR": str(home),
            # Steward's own modules, for a worker run from a source checkout.
            "PYTHONPATH": str(PROJECT_ROOT),
            "PYTHONUNBUFFERED": "1",
            # Spark binds the driver to loopback, as in the worker.
            "SPARK_LOCAL_IP": "127.0.0.1",
        }
    )
    if identity is not None and identity.switch and not has_passwd_entry(identity.uid):
        env.update(_passwd_view(home, identity))
    return env


def _passwd_view(home: Path, identity: TaskIdentity) -> dict[str, str]:
    """A passwd and group entry for a uid the system does not know (see the docstring)."""
    library = nss_wrapper_library()
    if library is None:
        return {"HADOOP_USER_NAME": f"steward-{identity.uid}"}
    name = f"steward-{identity.uid}"
    passwd = home / ".steward-passwd"
    group = home / ".steward-group"
    passwd.write_text(
        f"{name}:x:{identity.uid}:{identity.gid}:Steward task user:{home}:/bin/false\n"
    )
    group.write_text(f"{name}:x:{identity.gid}:\n")
    for path in (passwd, group):
        os.chmod(path, 0o644)
    return {
        "LD_PRELOAD": library,
        "NSS_WRAPPER_PASSWD": str(passwd),
        "NSS_WRAPPER_GROUP": str(group),
        "USER": name,
        "LOGNAME": name,
    }


class WorkArea:
    """The worker's directories for task processes (layout: module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        _private_dir(self.root, 0o711)
        for name in ("attempts", "homes", "code"):
            _private_dir(self.root / name, 0o711)
        self._code_lock = threading.Lock()
        self._attempts = str(self.root / "attempts")

    def home(self, identity: TaskIdentity) -> Path:
        path = self.root / "homes" / str(identity.uid)
        _owned_dir(path, identity, 0o700)
        return path

    def make_attempt_dir(self, identity: TaskIdentity) -> str:
        """A task process's working directory: ``0700``, the task user's, a random name."""
        path = f"{self._attempts}/{identity.uid}-{secrets.token_hex(8)}"
        os.mkdir(path, 0o700)
        try:
            if identity.switch:
                os.chown(path, identity.uid, identity.gid)
        except BaseException:
            os.rmdir(path)
            raise
        return path

    @staticmethod
    def attempt_dir_clean(path: str, identity: TaskIdentity) -> bool | None:
        """After an attempt: True when the directory is empty and still ``0700`` and the
        task user's (ready for the next attempt), False when it holds leftovers (see
        :func:`empty_dir`), None when it is unusable (make a new one).

        A directory per attempt would cost a mkdir, chown and rmdir per task (0.07-0.17 ms
        here, docs/BENCHMARKS.md); most tasks leave nothing, and this check is two syscalls.
        """
        try:
            info = os.lstat(path)
            if (
                not stat.S_ISDIR(info.st_mode)
                or stat.S_IMODE(info.st_mode) != 0o700
                or (identity.switch and info.st_uid != identity.uid)
            ):
                return None
            with os.scandir(path) as entries:
                return next(entries, None) is None
        except OSError:
            return None

    @staticmethod
    def remove_attempt_dir(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def code_copy(self, sha: str, verified: Path, identity: TaskIdentity) -> Path:
        """A copy of a verified artifact that ``identity`` may read and nobody else."""
        if not identity.switch:
            return verified  # the task runs as the worker: it can read the cache anyway
        parent = self.root / "code" / str(identity.uid)
        with self._code_lock:
            if not parent.is_dir():
                parent.mkdir(mode=0o750)
                os.chown(parent, 0, identity.gid)
            target = parent / verified.name
            if target.exists():
                return target
            tmp = parent / f".{sha[:12]}-{secrets.token_hex(4)}"
            try:
                if verified.is_dir():
                    shutil.copytree(verified, tmp, symlinks=False)
                else:
                    shutil.copyfile(verified, tmp)
                _share_tree(tmp, identity.gid)
                try:
                    os.rename(tmp, target)
                except OSError:
                    if not target.exists():  # not "another worker sharing the dir was first"
                        raise
            finally:
                if tmp.is_dir():
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink(missing_ok=True)
            return target


def _private_dir(path: Path, mode: int) -> None:
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    info = path.lstat()
    if path.is_symlink() or info.st_uid != os.geteuid():
        raise TaskProcessError(f"{path} is not a directory of this worker's user")
    os.chmod(path, mode)


def _owned_dir(path: Path, identity: TaskIdentity, mode: int) -> None:
    path.mkdir(mode=mode, exist_ok=True)
    if identity.switch:
        os.chown(path, identity.uid, identity.gid)
    os.chmod(path, mode)


def _share_tree(root: Path, gid: int) -> None:
    """root:gid, directories 0750 and files 0640: readable by the group only."""
    paths = [root] if root.is_file() else [root, *root.rglob("*")]
    for path in paths:
        os.chown(path, 0, gid, follow_symlinks=False)
        if not path.is_symlink():
            os.chmod(path, 0o750 if path.is_dir() else 0o640)


def empty_dir(path: str) -> bool:
    """Remove what is in a directory, keeping it (symlinks are removed, never followed);
    False when something could not be removed. The worker and a task process (for its own
    working directory, between the attempts it runs) both use it."""
    try:
        with os.scandir(path) as entries:
            leftovers = [(entry.path, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for leftover, is_dir in leftovers:
            if is_dir:
                shutil.rmtree(leftover)
            else:
                os.unlink(leftover)
    except OSError:
        return False
    return True


def lock_work_dir(
    root: Path, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None
) -> int:
    """Take the work directory's lock for as long as this process runs; its fd.

    Two workers in one directory would mix their Spark servers, attempt directories and
    code copies. The fd is not inherited (task processes and the Spark server do not hold
    it), so a worker killed with -9 frees it at once. WorkDirInUseError when another worker
    still holds it after ``wait_s`` (``on_wait`` is told, once, what it waits for);
    TaskProcessError when the directory is another user's
    or a symlink; OSError when it cannot be made.
    """
    deadline = time.monotonic() + wait_s
    path = root / WORK_DIR_LOCK
    told = False
    while True:
        root.mkdir(mode=0o711, parents=True, exist_ok=True)
        info = root.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            # Someone else's (in /tmp, anybody can make the default's name first).
            raise TaskProcessError(f"{root} is not a directory of this worker's user")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            in_use = f"work dir {root} is in use by another worker{holder}"
            if time.monotonic() >= deadline:
                raise WorkDirInUseError(
                    f"{in_use}: give each worker a --work-dir of its own (or a --worker-id "
                    "of its own, with the default)"
                ) from None
            if on_wait is not None and not told:
                on_wait(in_use)
                told = True
            time.sleep(_LOCK_POLL_S)  # a stopping worker's lock: nothing to wait on but it
            continue
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_ino, current.st_dev) == (
            held.st_ino,
            held.st_dev,
        ):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        # Its holder removed the directory on exit after we opened the file: a lock on
        # that unlinked file would guard nothing. Start over with a new one.
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


def remove_work_dir(root: Path) -> bool:
    """Remove a worker's own default work directory as it exits cleanly; False when some
    of it could not be removed (a task process that outlived the worker writing there)."""
    shutil.rmtree(root, ignore_errors=True)
    return not root.exists()
