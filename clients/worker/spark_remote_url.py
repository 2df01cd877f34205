"""A ``--spark-remote`` URL (``sc://HOST[:PORT][/;key=value...]``): parsed, checked, with
its token added. Pure: the worker's config checks it (clients/worker/config.py) and the
remote Spark room uses it (clients/worker/spark/remote.py), so it sits below both.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Final

#: The Spark Connect user id of every session (a session is found by user id and session id).
USER_ID: Final = "steward"
DEFAULT_PORT: Final = 15002  # Spark Connect's
#: The remote server's token, if not in a file (removed from the environment once read).
TOKEN_ENV: Final = "STEWARD_SPARK_REMOTE_TOKEN"
#: Parameters Steward sets itself (one session per attempt).
_RESERVED: Final = frozenset({"user_id", "session_id"})


@dataclass(frozen=True)
class RemoteUrl:
    """A parsed ``sc://`` URL: where the server is and the parameters to pass it."""

    host: str
    port: int
    params: tuple[tuple[str, str], ...]

    @property
    def address(self) -> str:
        """``sc://HOST:PORT``: for messages and logs (no token)."""
        return f"sc://{self.host}:{self.port}"

    def base(self) -> str:
        return self.address + "/" + "".join(f";{key}={value}" for key, value in self.params)

    def session_url(self, session_id: str) -> str:
        return f"{self.base()};user_id={USER_ID};session_id={session_id}"


def parse_remote(url: str) -> RemoteUrl:
    """``sc://HOST[:PORT][/;key=value...]``; ValueError saying what is wrong."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "sc" or not parsed.hostname:
        raise ValueError(f"--spark-remote must look like sc://HOST:PORT[/;token=...], got {url!r}")
    try:
        port = parsed.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"--spark-remote: not a port in {parsed.netloc!r}") from None
    if parsed.username or parsed.password or parsed.query or parsed.fragment:
        raise ValueError("--spark-remote: parameters go after '/;' (sc://HOST:PORT/;token=...)")
    path = parsed.path
    params: list[tuple[str, str]] = []
    if path not in ("", "/"):
        if not path.startswith("/;"):
            raise ValueError("--spark-remote: parameters go after '/;' (sc://HOST:PORT/;token=...)")
        for pair in path[2:].split(";"):
            key, sep, value = pair.partition("=")
            if not sep or not key or not value:
                raise ValueError(f"--spark-remote: parameter {key or pair!r} needs key=value")
            if key in _RESERVED:
                raise ValueError(
                    f"--spark-remote: {key} is set by Steward (a session per task attempt)"
                )
            params.append((key, value))
    host = parsed.hostname
    return RemoteUrl(f"[{host}]" if ":" in host else host, port, tuple(params))


def with_token(url: str, token: str | None) -> str:
    """``url`` with ``;token=`` added (the token from a file or the environment)."""
    remote = parse_remote(url)
    if token is None:
        return url
    if any(key == "token" for key, _ in remote.params):
        raise ValueError(
            "--spark-remote has a token already: give it in the URL or in"
            f" --spark-remote-token-file / {TOKEN_ENV}, not both"
        )
    if not token or any(c in token for c in ";/ \t\n"):
        raise ValueError("the Spark Connect token is empty or holds ';', '/' or whitespace")
    return RemoteUrl(remote.host, remote.port, (*remote.params, ("token", token))).base()
