"""Code artifacts: a sha256-addressed download cache and per-version isolated imports.

Cache layout (``cache_dir``)::

    <sha>.py | <sha>.zip    the verified artifact (a wheel is stored as .zip)
    <sha>/                  a .zip/.whl extracted, modules at its root

Artifacts are downloaded from ``GET {http_url}/api/v1/code/{sha}``, hashed while
streaming, and renamed into place only when the hash matches, so a file in the cache
is always complete (several worker processes may share one cache directory). Within a
process, concurrent requests for one sha wait for a single download. The cache is the
worker's own: directories 0700, files 0600.

Nothing cached is trusted across a restart: before a process first uses a cached file
it hashes it again (a mismatch is removed and downloaded again), and before it first
uses an unpacked tree it compares every file with the verified archive (any difference,
missing or extra file: the tree is unpacked again; ``__pycache__`` directories are
dropped, as a planted ``.pyc`` would run instead of its verified source). Archives are
unpacked under the same bounds as on upload (``broker/artifacts/artifact_check.py``: entry count,
inflated size and ratio, counted while inflating in chunks), and a ``.py`` over
``max_py_bytes`` is refused.

Isolation. Every artifact version is imported under its own package prefix
``steward_artifact_<sha12>``; nothing is added to ``sys.path``:

- a ``.py`` artifact *is* the module ``steward_artifact_<sha12>``; the module part of
  ``module:function`` is not checked (the broker keeps no file name), so use the file's
  stem by convention;
- a ``.zip``/``.whl`` artifact's top-level modules become submodules of the prefix, so
  ``jobs.main:run`` is imported as ``steward_artifact_<sha12>.jobs.main``. Two versions
  of ``jobs`` live side by side in ``sys.modules`` under different prefixes and a task
  always gets the version of its own artifact, also while tasks of both run at once.

Absolute imports between an artifact's own modules (``import jobs.util``,
``from jobs import util``) work because every module of an artifact is executed with
its own ``__builtins__`` whose ``__import__`` maps the artifact's top-level names to the
prefixed ones. That is scoped per module, not per thread, so it has no races. Limits:

- only ``import`` statements and ``__import__`` are mapped: ``importlib.import_module(
  "jobs.util")`` or ``pkgutil``/entry-point lookups by the bare name inside an artifact do
  not see it (use relative imports or the ``import`` statement);
- a top-level name of the artifact shadows an installed module of that name for the
  artifact's own code (that is the point); other code in the process never sees it;
- modules are cached per version for the life of the process (module-level state is
  shared by the tasks of one version; no unloading);
- the archive's modules must sit at its root (as in a wheel), not under a folder;
- code shipped to Spark's Python workers is pickled by value (each artifact is
  registered with cloudpickle), so executors need no copy of the artifact; an
  ``import`` of the artifact's own modules run *on an executor* inside a function body
  is not mapped there: import at module level.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import ssl
import stat
import sys
import tempfile
import threading
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

import httpx

from broker.artifacts.artifact_check import (
    ArtifactLimits,
    InvalidArtifactError,
    iter_zip_members,
    write_private_file,
)
from broker.core.entries import SHA256_RE
from broker.security.auth import bearer_headers
from clients.worker.config import DEFAULT_MAX_CACHE_BYTES
from log.private_fs import make_private_dirs

logger = logging.getLogger(__name__)

PREFIX: Final = "steward_artifact_"
_ZIP_MAGIC: Final = (b"PK\x03\x04", b"PK\x05\x06")
_CHUNK_BYTES: Final = 1024 * 1024


class ArtifactError(Exception):
    """An artifact cannot be fetched, verified or loaded."""


@dataclass(frozen=True)
class _Scope:
    """One artifact version's import namespace."""

    prefix: str
    root: Path
    top_names: frozenset[str]
    builtins: dict[str, Any]


def _scoped_builtins(prefix: str, top_names: frozenset[str]) -> dict[str, Any]:
    def scoped_import(
        name: str,
        globals: dict[str, Any] | None = None,  # __import__'s own parameter names
        locals: dict[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> types.ModuleType:
        head = name.partition(".")[0]
        if level == 0 and head in top_names:
            module = builtins.__import__(f"{prefix}.{name}", globals, locals, fromlist, 0)
            # `import jobs.util` binds `jobs`: hand back the prefixed top package.
            return module if fromlist else sys.modules[f"{prefix}.{head}"]
        return builtins.__import__(name, globals, locals, fromlist, level)

    scoped = dict(vars(builtins))
    scoped["__import__"] = scoped_import
    return scoped


class _ScopedLoader(importlib.abc.Loader):
    """Runs a module of an artifact with the artifact's own ``__builtins__``."""

    def __init__(self, inner: importlib.abc.Loader, scope: _Scope) -> None:
        self._inner = inner
        self._scope = scope

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["__builtins__"] = self._scope.builtins
        self._inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_resource_reader, is_package...: the wrapped loader's.
        return getattr(self._inner, name)


class _ArtifactFinder(importlib.abc.MetaPathFinder):
    """Finds ``steward_artifact_*`` submodules inside their artifact's directory only."""

    def __init__(self) -> None:
        self._scopes: dict[str, _Scope] = {}
        self._lock = threading.Lock()

    def add(self, scope: _Scope) -> None:
        with self._lock:
            self._scopes[scope.prefix] = scope

    def get(self, prefix: str) -> _Scope | None:
        with self._lock:
            return self._scopes.get(prefix)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, dot, _ = fullname.partition(".")
        if not dot or not prefix.startswith(PREFIX):
            return None
        scope = self.get(prefix)
        if scope is None:
            return None
        # `path` is the parent package's __path__, inside the artifact directory.
        spec = importlib.machinery.PathFinder.find_spec(fullname, path or [str(scope.root)])
        if spec is None:
            # Stop here: falling through to sys.path could import another version.
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        if isinstance(
            spec.loader,
            importlib.machinery.SourceFileLoader | importlib.machinery.SourcelessFileLoader,
        ):
            spec.loader = _ScopedLoader(spec.loader, scope)
        return spec


_finder_lock = threading.Lock()
_finder: _ArtifactFinder | None = None


def _artifact_finder() -> _ArtifactFinder:
    """The one finder of this process (artifact modules live in the process-wide sys.modules)."""
    global _finder
    with _finder_lock:
        if _finder is None:
            _finder = _ArtifactFinder()
            sys.meta_path.insert(0, _finder)
        return _finder


def _register_pickle_by_value(module: types.ModuleType) -> None:
    """Spark's Python workers cannot import artifact modules: ship their code by value."""
    try:
        from pyspark import cloudpickle
    except ImportError:  # pragma: no cover - pyspark is a dependency
        return
    # Registering a package covers its submodules; registering twice is harmless.
    cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]


def _resolve_attr(obj: Any, dotted: str, where: str) -> Any:
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ArtifactError(f"{where} has no attribute {dotted!r}") from None
    return obj


@dataclass(frozen=True)
class LoadedArtifact:
    sha: str
    kind: str  # "py" or "zip"
    prefix: str
    module: types.ModuleType  # the .py module, or the prefix package of an archive
    top_names: frozenset[str]

    def resolve(self, target: str) -> Callable[..., Any]:
        """``module:function`` (function may be dotted, e.g. ``Class.method``) -> callable."""
        module_name, sep, attr = target.partition(":")
        if not sep or not attr or not all(p.isidentifier() for p in attr.split(".")):
            raise ArtifactError(f"expected 'module:function', got {target!r}")
        if self.kind == "py":
            module = self.module
        else:
            parts = module_name.split(".")
            if not all(p.isidentifier() for p in parts):
                raise ArtifactError(f"bad module name {module_name!r} in {target!r}")
            if parts[0] not in self.top_names:
                raise ArtifactError(
                    f"artifact {self.sha[:12]} has no top-level module {parts[0]!r}"
                    f" (it has: {', '.join(sorted(self.top_names)) or 'none'})"
                )
            module = importlib.import_module(f"{self.prefix}.{module_name}")
        fn = _resolve_attr(module, attr, f"module {module_name!r}")
        if not callable(fn):
            raise ArtifactError(f"{target!r} is not callable")
        return fn  # type: ignore[no-any-return]


class ArtifactCache:
    """Downloads, verifies, caches and loads code artifacts. Thread-safe."""

    def __init__(
        self,
        cache_dir: Path,
        http_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_artifact_bytes: int = 1024 * 1024 * 1024,
        transport: httpx.BaseTransport | None = None,
        ssl_context: ssl.SSLContext | None = None,
        limits: ArtifactLimits | None = None,
        max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        # Least recently used artifacts go past this (0: unbounded); see _trim.
        self.max_cache_bytes = max_cache_bytes
        self.http_url = http_url.rstrip("/")
        self.max_artifact_bytes = max_artifact_bytes
        self.limits = limits or ArtifactLimits()
        headers = bearer_headers(token)
        # https:// brokers are verified with ssl_context (default: httpx's, certifi).
        self._client = httpx.Client(
            timeout=timeout_s,
            headers=headers,
            transport=transport,
            verify=ssl_context if ssl_context is not None else True,
        )
        self._lock = threading.Lock()
        self._sha_locks: dict[str, threading.Lock] = {}
        self._loaded: dict[str, LoadedArtifact] = {}
        # Cached files and unpacked trees checked by this process (see the module doc).
        self._verified_files: set[str] = set()
        self._verified_trees: set[str] = set()
        self.downloads = 0  # completed downloads, for tests and metrics

    def close(self) -> None:
        self._client.close()

    def drop(self, sha: str) -> bool:
        """Remove a deleted artifact (docs/DESIGN.md §7) from the cache: its file and its
        unpacked tree. Modules this process already imported stay loaded; a later task of
        it downloads it again (and gets a 404 if it is really gone). True if a file went."""
        self.check_sha(sha)
        with self._sha_lock(sha):
            removed = self._remove_locked(sha)
        if removed:
            count, size_bytes = self.usage()
            logger.info(
                "artifact %s dropped from the cache (deleted); cache: %d artifacts, %d bytes",
                sha[:12],
                count,
                size_bytes,
            )
        return removed

    def usage(self) -> tuple[int, int]:
        """(artifact count, bytes of their archives/files) in the cache directory."""
        count = size_bytes = 0
        for _sha, _path, size, _used in self._cached_entries():
            count += 1
            size_bytes += size
        return count, size_bytes

    def _cached_entries(self) -> list[tuple[str, Path, int, float]]:
        """(sha, file, size, last use) of every cached artifact file."""
        found = []
        for name in _listdir(self.cache_dir):
            sha, dot, suffix = name.partition(".")
            if not dot or suffix not in ("py", "zip") or not SHA256_RE.fullmatch(sha):
                continue
            path = self.cache_dir / name
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((sha, path, st.st_size, st.st_mtime))
        return found

    def _remove_locked(self, sha: str) -> bool:
        removed = False
        for suffix in (".py", ".zip"):
            path = self.cache_dir / f"{sha}{suffix}"
            if path.is_file():
                path.unlink(missing_ok=True)
                removed = True
        tree = self.cache_dir / sha
        if tree.is_dir():
            self._move_aside(sha, tree)
        self._drop_bytecode(sha)
        self._verified_files.discard(sha)
        self._verified_trees.discard(sha)
        self._loaded.pop(sha, None)
        return removed

    def _trim(self, keep: str) -> None:
        """Past ``max_cache_bytes``: remove the least recently used artifacts (by the
        file's mtime, touched on each use), never ``keep`` nor one this process loaded
        (its tasks may still import from it). Another process's in-use artifact may go:
        it is downloaded again when needed."""
        if not self.max_cache_bytes:
            return
        entries = sorted(self._cached_entries(), key=lambda entry: entry[3])
        total = sum(entry[2] for entry in entries)
        for sha, _path, size, _used in entries:
            if total <= self.max_cache_bytes:
                break
            if sha == keep or sha in self._loaded:
                continue
            lock = self._sha_lock(sha)
            if not lock.acquire(blocking=False):
                continue  # in use by another thread right now
            try:
                self._remove_locked(sha)
            finally:
                lock.release()
            total -= size
            logger.info("artifact %s evicted from the cache (least recently used)", sha[:12])

    def _sha_lock(self, sha: str) -> threading.Lock:
        with self._lock:
            return self._sha_locks.setdefault(sha, threading.Lock())

    @staticmethod
    def check_sha(sha: str) -> str:
        if not SHA256_RE.fullmatch(sha):
            raise ArtifactError(f"not a sha256 hex digest: {sha!r}")
        return sha

    def load(self, sha: str) -> LoadedArtifact:
        """The artifact's module(s), downloading and extracting it first when needed."""
        self.check_sha(sha)
        loaded = self._loaded.get(sha)
        if loaded is not None:
            return loaded
        with self._sha_lock(sha):
            loaded = self._loaded.get(sha)
            if loaded is None:
                loaded = self._load_locked(sha)
                self._loaded[sha] = loaded
            return loaded

    def resolve(self, sha: str, target: str) -> Callable[..., Any]:
        return self.load(sha).resolve(target)

    def fetch(self, sha: str) -> Path:
        """The verified artifact file (``<sha>.py`` or ``<sha>.zip``), downloaded if missing."""
        self.check_sha(sha)
        with self._sha_lock(sha):
            return self._fetch_locked(sha)

    # -- internals (caller holds the sha's lock) --

    def _cached_file(self, sha: str) -> Path | None:
        for suffix in (".py", ".zip"):
            path = self.cache_dir / f"{sha}{suffix}"
            if path.is_file():
                return path
        return None

    def _fetch_locked(self, sha: str) -> Path:
        path = self._cached_file(sha)
        if path is not None and sha not in self._verified_files:
            # First use by this process: the file may have changed while no process ran.
            if _file_sha256(path) == sha:
                self._verified_files.add(sha)
                if path.suffix == ".py":
                    self._drop_bytecode(sha)
            else:
                logger.warning("cached artifact %s is corrupt; downloading it again", path)
                path.unlink(missing_ok=True)
                path = None
        if path is None:
            path = self._download(sha)
            self._verified_files.add(sha)
            self._trim(keep=sha)
            count, size_bytes = self.usage()
            logger.info("artifact cache: %d artifacts, %d bytes", count, size_bytes)
        else:
            with contextlib.suppress(OSError):
                os.utime(path)  # the LRU order of _trim
        if path.suffix == ".py" and path.stat().st_size > self.limits.max_py_bytes:
            raise ArtifactError(
                f"artifact {sha[:12]} is a .py of more than {self.limits.max_py_bytes} bytes"
            )
        return path

    def _drop_bytecode(self, sha: str) -> None:
        """A ``.pyc`` left beside a cached ``.py`` would run instead of the verified source."""
        pycache = self.cache_dir / "__pycache__"
        for name in _listdir(pycache):
            if name.startswith(f"{sha}."):
                (pycache / name).unlink(missing_ok=True)

    def _download(self, sha: str) -> Path:
        make_private_dirs(self.cache_dir)
        url = f"{self.http_url}/api/v1/code/{sha}"
        digest = hashlib.sha256()
        size = 0
        head = b""
        fd, tmp_name = tempfile.mkstemp(prefix=f".{sha[:12]}-", suffix=".part", dir=self.cache_dir)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                try:
                    with self._client.stream("GET", url) as response:
                        if response.status_code == 404:
                            raise ArtifactError(f"artifact {sha} not found at {url}")
                        if response.status_code != 200:
                            raise ArtifactError(
                                f"downloading artifact {sha} from {url}:"
                                f" HTTP {response.status_code}"
                            )
                        for chunk in response.iter_bytes(_CHUNK_BYTES):
                            size += len(chunk)
                            if size > self.max_artifact_bytes:
                                raise ArtifactError(
                                    f"artifact {sha} exceeds {self.max_artifact_bytes} bytes"
                                )
                            if len(head) < 4:
                                head += chunk[:4]
                            digest.update(chunk)
                            out.write(chunk)
                except httpx.HTTPError as exc:
                    raise ArtifactError(f"downloading artifact {sha} from {url}: {exc}") from exc
                out.flush()
                os.fsync(out.fileno())
            got = digest.hexdigest()
            if got != sha:
                raise ArtifactError(
                    f"artifact sha256 mismatch: asked for {sha}, downloaded {size} bytes"
                    f" with sha256 {got}"
                )
            suffix = ".zip" if head[:4] in _ZIP_MAGIC else ".py"
            final = self.cache_dir / f"{sha}{suffix}"
            os.replace(tmp, final)  # atomic: readers see the whole file or none
            self.downloads += 1
            logger.info("downloaded artifact %s (%d bytes)", sha[:12], size)
            return final
        finally:
            tmp.unlink(missing_ok=True)

    def _extract(self, sha: str, archive: Path) -> Path:
        """The archive unpacked to ``<sha>/``, checked against the archive once per process."""
        target = self.cache_dir / sha
        if sha in self._verified_trees and target.is_dir():
            return target
        if target.is_dir():
            if self._tree_matches(sha, archive, target):
                self._verified_trees.add(sha)
                return target
            logger.warning("unpacked artifact %s differs from its archive; unpacking it again", sha)
            self._move_aside(sha, target)
        make_private_dirs(self.cache_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", suffix=".extract", dir=self.cache_dir))
        try:
            self._unpack(sha, archive, tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():  # not "another process extracted it first"
                    raise
                # Check that copy like any other found in place.
                if not self._tree_matches(sha, archive, target):
                    raise ArtifactError(
                        f"unpacked artifact {sha[:12]} at {target} keeps changing"
                    ) from None
            self._verified_trees.add(sha)
            return target
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _members(
        self, sha: str, archive: Path
    ) -> Iterator[tuple[PurePosixPath, bool, Iterator[bytes]]]:
        """``iter_zip_members`` of the cached archive, under the worker's limits."""
        with archive.open("rb") as file:
            try:
                for path, is_dir, chunks in iter_zip_members(
                    file, self.limits, f"artifact {sha[:12]}"
                ):
                    yield path, is_dir, _artifact_errors(chunks)
            except InvalidArtifactError as exc:
                raise ArtifactError(str(exc)) from None

    def _unpack(self, sha: str, archive: Path, into: Path) -> None:
        for path, is_dir, chunks in self._members(sha, archive):
            dest = into.joinpath(*path.parts)
            try:
                if is_dir:
                    make_private_dirs(dest)
                else:
                    make_private_dirs(dest.parent)
                    write_private_file(dest, chunks)
            except OSError as exc:
                raise ArtifactError(f"artifact {sha[:12]}: cannot unpack {path}: {exc}") from None

    def _tree_matches(self, sha: str, archive: Path, root: Path) -> bool:
        """Whether ``root`` holds exactly the archive's files, byte for byte.

        Inflates the (verified) archive again, in chunks under the limits, and hashes
        both sides; ``__pycache__`` directories the archive lacks are removed.
        """
        files: dict[PurePosixPath, str] = {}
        dirs: set[PurePosixPath] = set()
        for path, is_dir, chunks in self._members(sha, archive):
            dirs.update(p for p in path.parents if p != PurePosixPath("."))
            if is_dir:
                dirs.add(path)
            else:
                digest = hashlib.sha256()
                for chunk in chunks:
                    digest.update(chunk)
                files[path] = digest.hexdigest()
        for dirpath, dirnames, filenames in os.walk(root):
            here = PurePosixPath(os.path.relpath(dirpath, root))
            for name in list(dirnames):
                full = os.path.join(dirpath, name)
                if os.path.islink(full):
                    return False
                if here / name not in dirs:
                    if name != "__pycache__":
                        return False
                    shutil.rmtree(full, ignore_errors=True)
                    dirnames.remove(name)
            for name in filenames:
                full = os.path.join(dirpath, name)
                wanted = files.pop(here / name, None)
                if wanted is None or not stat.S_ISREG(os.lstat(full).st_mode):
                    return False
                if _file_sha256(Path(full)) != wanted:
                    return False
        return not files  # none missing

    def _move_aside(self, sha: str, target: Path) -> None:
        stale = self.cache_dir / f".{sha[:12]}-{uuid.uuid4().hex}.stale"
        try:
            os.rename(target, stale)
        except FileNotFoundError:
            return  # another process moved it
        shutil.rmtree(stale, ignore_errors=True)

    def _load_locked(self, sha: str) -> LoadedArtifact:
        path = self._fetch_locked(sha)
        return load_verified(sha, path if path.suffix == ".py" else self._extract(sha, path))

    def verified_copy(self, sha: str) -> Path:
        """The artifact's verified ``<sha>.py`` file or extracted directory, fetched if missing.

        Task processes import from a copy of this (``clients/worker/task_processes/pool.py``).
        """
        self.check_sha(sha)
        with self._sha_lock(sha):
            path = self._fetch_locked(sha)
            return path if path.suffix == ".py" else self._extract(sha, path)


class CodeDrops:
    """Drops the artifacts a broker's heartbeats name as deleted (docs/DESIGN.md §7) from
    the cache: each once (the broker repeats them for a while), off the event loop (file
    work, and a download of the same sha may hold its lock)."""

    def __init__(self, cache: ArtifactCache) -> None:
        self._cache = cache
        self._seen: frozenset[str] = frozenset()  # what the last heartbeat named
        self._background: set[asyncio.Task[None]] = set()

    def on_heartbeat(self, shas: tuple[str, ...]) -> None:
        seen, self._seen = self._seen, frozenset(shas)
        new = [sha for sha in shas if sha not in seen and SHA256_RE.fullmatch(sha)]
        if not new:
            return
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._drop_all, new))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _drop_all(self, shas: list[str]) -> None:
        for sha in shas:
            try:
                self._cache.drop(sha)
            except OSError as exc:
                logger.warning("artifact %s: could not drop it from the cache: %s", sha, exc)


def load_verified(sha: str, path: Path) -> LoadedArtifact:
    """Import an artifact from a verified local copy: a ``.py`` file or an extracted archive."""
    prefix = f"{PREFIX}{sha[:12]}"
    existing = sys.modules.get(prefix)
    finder = _artifact_finder()
    if existing is not None and getattr(existing, "__steward_sha__", None) not in (None, sha):
        raise ArtifactError(f"artifact prefix collision for {sha} and {existing}")
    if not path.is_dir():
        module = existing or _exec_py_module(prefix, path, sha)
        loaded = LoadedArtifact(sha, "py", prefix, module, frozenset())
    else:
        top_names = _top_level_names(path)
        scope = _Scope(prefix, path, top_names, _scoped_builtins(prefix, top_names))
        finder.add(scope)
        module = existing or _package_module(prefix, path, sha)
        # Another cache in this process may have loaded this sha from another directory
        # (tests): point lazy imports at this copy.
        module.__path__ = [str(path)]
        loaded = LoadedArtifact(sha, "zip", prefix, module, top_names)
    _register_pickle_by_value(module)
    return loaded


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _artifact_errors(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """A member's chunks, a bound crossed while inflating raised as an ArtifactError."""
    try:
        yield from chunks
    except InvalidArtifactError as exc:
        raise ArtifactError(str(exc)) from None


def _listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _top_level_names(root: Path) -> frozenset[str]:
    names = set()
    for entry in root.iterdir():
        name = entry.name
        if entry.is_dir():
            if name.isidentifier() and name != "__pycache__":
                names.add(name)
        elif name.endswith(".py") or name.endswith(".pyc"):
            stem = name.rsplit(".", 1)[0]
            if stem.isidentifier():
                names.add(stem)
        elif any(name.endswith(suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES):
            stem = name.split(".", 1)[0]
            if stem.isidentifier():
                names.add(stem)
    return frozenset(names)


def _package_module(prefix: str, root: Path, sha: str) -> types.ModuleType:
    spec = importlib.machinery.ModuleSpec(prefix, None, is_package=True)
    spec.submodule_search_locations = [str(root)]
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(root)]
    module.__steward_sha__ = sha  # type: ignore[attr-defined]
    sys.modules[prefix] = module
    return module


def _exec_py_module(prefix: str, path: Path, sha: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(prefix, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py path always has one
        raise ArtifactError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    module.__steward_sha__ = sha  # type: ignore[attr-defined]
    sys.modules[prefix] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(prefix, None)
        raise
    return module
