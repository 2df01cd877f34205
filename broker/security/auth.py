"""Who is calling: API tokens, roles and the authorization rules' vocabulary.

Authentication is off unless the broker is given an admin token (``--admin-token-file``
or ``STEWARD_ADMIN_TOKEN``): then every API call but ``/healthz``, the OpenAPI document
and the dashboard's static page needs ``Authorization: Bearer <token>``.

Four kinds of callers:

- ``admin``: the bootstrap token from the broker's configuration, or a token created
  with role admin. Everything, including tenants' service levels, tokens and cluster
  operations.
- ``tenant``: a token created for one tenant. Its own tasks, transactions and code
  artifacts only; anything else answers as if it did not exist (404) or 403, and never
  shows another tenant's ids or counts.
- ``worker``: a worker credential created through the API with role worker (scoped:
  optionally to some tenants; the worker link binds each connection to it, see
  broker/workers/worker_link.py), or the workers' shared token (``--worker-token-file``; legacy,
  unscoped). Finding the leader, and downloading the code artifacts of tasks currently
  running on the credential's own connected workers.
- ``peer``: the brokers' shared token (``--cluster-token-file``): snapshot and code
  downloads between brokers, the state digest.

Tokens created through the API live in the replicated state as SHA-256 hashes (the
secret is shown once, in the creation's answer, and is never logged): every broker can
check them, followers included, and a revocation reaches every broker with the log.
Tokens are 256-bit random strings, so a plain SHA-256 (no salt, no slow hash) is enough:
nobody can guess a preimage, and a fast hash keeps the per-request check cheap.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

TOKEN_PREFIX: Final = "stw_"


class Role(enum.StrEnum):
    ADMIN = "admin"
    TENANT = "tenant"
    WORKER = "worker"
    PEER = "peer"


@dataclass(frozen=True, slots=True)
class Principal:
    role: Role
    tenant: str | None = None  # set for Role.TENANT only
    token_id: str | None = None  # None: a token from the configuration

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    def may_see_tenant(self, tenant: str) -> bool:
        return self.role is Role.ADMIN or (self.role is Role.TENANT and self.tenant == tenant)


#: The caller when authentication is off: it may do everything (with no tokens configured,
#: the operator trusts whoever reaches the port).
ANONYMOUS_ADMIN: Final = Principal(Role.ADMIN)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def new_token() -> str:
    """A fresh secret: 256 random bits, URL-safe, recognisable by its prefix."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_token_id() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True)
class AuthConfig:
    """Secrets from the configuration, kept hashed in memory too."""

    admin_token_hashes: frozenset[str] = frozenset()
    worker_token_hash: str | None = None
    peer_token_hash: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.admin_token_hashes)

    @classmethod
    def from_secrets(
        cls,
        admin_tokens: list[str] | tuple[str, ...] = (),
        worker_token: str | None = None,
        peer_token: str | None = None,
    ) -> AuthConfig:
        return cls(
            admin_token_hashes=frozenset(hash_token(t) for t in admin_tokens if t),
            worker_token_hash=hash_token(worker_token) if worker_token else None,
            peer_token_hash=hash_token(peer_token) if peer_token else None,
        )

    def configured_principal(self, token_hash: str) -> Principal | None:
        """The caller a configuration token names (constant-time comparisons)."""
        found: Principal | None = None
        for admin_hash in self.admin_token_hashes:
            if hmac.compare_digest(admin_hash, token_hash):
                found = Principal(Role.ADMIN)
        if self.peer_token_hash is not None and hmac.compare_digest(
            self.peer_token_hash, token_hash
        ):
            found = found or Principal(Role.PEER)
        if self.worker_token_hash is not None and hmac.compare_digest(
            self.worker_token_hash, token_hash
        ):
            found = found or Principal(Role.WORKER)
        return found


class AuthError(Exception):
    """401: no credentials, or credentials nobody issued."""


def bearer_token(header: bytes | None) -> str:
    """The token of an ``Authorization: Bearer`` header; AuthError when absent or malformed."""
    if header is None:
        raise AuthError("this broker requires an API token: send Authorization: Bearer <token>")
    scheme, _, value = header.decode("latin-1").strip().partition(" ")
    token = value.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError("the Authorization header must be 'Bearer <token>'")
    return token


def bearer_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header that presents ``token`` (none without a token)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def read_secret(path: str | os.PathLike[str]) -> str:
    """A secret kept in a file (first line, surrounding whitespace ignored)."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.strip().splitlines()
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise ValueError(f"{path}: the file holds no token")
    return secret


class SecretOptionError(ValueError):
    """A secret option is unusable (unreadable file, or given twice); a usage error."""


def secret_from_options(
    *,
    argv_value: str | None,
    argv_flag: str,
    file: str | os.PathLike[str] | None,
    file_flag: str,
    env: str,
    warn: Callable[[str], None],
) -> str | None:
    """A secret from its file option, its (deprecated) command-line option or the
    environment variable ``env``, in that order; None when none is given.

    A secret on the command line is readable by every local user (``/proc/PID/cmdline``,
    ``ps``): it still works, with ``warn`` called once. ``env`` is removed from
    ``os.environ`` either way, so child processes (task code, a JVM) never inherit it.
    """
    from_env = os.environ.pop(env, None)
    if file is not None and argv_value is not None:
        raise SecretOptionError(f"give {file_flag} or {argv_flag}, not both")
    if file is not None:
        try:
            return read_secret(file)
        except (OSError, ValueError) as exc:
            raise SecretOptionError(f"{file_flag}: {exc}") from None
    if argv_value is not None:
        warn(
            f"{argv_flag} on the command line is deprecated: every local user can read it "
            f"(ps, /proc/PID/cmdline); use {file_flag} PATH or the environment variable {env}"
        )
        return argv_value
    return from_env or None


def kazoo_auth_options(credentials: str | None) -> dict[str, Any]:
    """``KazooClient`` keyword arguments for ZooKeeper digest authentication.

    With ``"user:password"``, the session authenticates and every znode it creates gets
    an ACL granting everything to that identity only, so other ZooKeeper users can
    neither read nor change Steward's election, ledger list or code replicas.
    """
    if credentials is None:
        return {}
    user, sep, password = credentials.partition(":")
    if not sep or not user or not password:
        raise ValueError("ZooKeeper credentials must be USER:PASSWORD")
    from kazoo.security import make_digest_acl  # type: ignore[import-untyped]

    return {
        "auth_data": [("digest", credentials)],
        "default_acl": [make_digest_acl(user, password, all=True)],
    }
