"""Argument types and the option groups several commands share (broker, HTTP edge, TLS,
log format options), the CLI's defaults and its usage error."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from broker.security.tls import CA_ENV, TlsConfig, TlsConfigError
from clients.client import (
    parse_urls,
)

DEFAULT_URL = "http://127.0.0.1:8080"
# Shorter than the library's 30 s: someone is waiting at the terminal.
DEFAULT_FAILOVER_TIMEOUT_S = 10.0


class UsageError(Exception):
    pass


def _host_port(text: str) -> tuple[str, int]:
    _, has_scheme, rest = text.partition("://")
    if has_scheme:  # a listen address, not a URL: say what to write instead
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got a URL: write {rest!r}")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _broker_urls(text: str) -> list[str]:
    try:
        return parse_urls(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def _tenant_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected TENANT[,TENANT...], got {text!r}")
    return names


def _resource(text: str) -> tuple[str, float]:
    name, sep, amount = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT, got {text!r}") from None


def _add_path_option(p: argparse.ArgumentParser, flag: str, env: str, help: str) -> None:
    """An option naming a file, by default the one environment variable ``env`` names."""
    p.add_argument(flag, type=Path, default=os.environ.get(env), metavar="PATH", help=help)


def _add_deprecated_secret_option(p: argparse.ArgumentParser, flag: str, env: str) -> None:
    """A secret given on the command line (``flag``), superseded by ``flag``-file and ``env``."""
    p.add_argument(
        flag,
        default=None,
        help=f"deprecated (readable by every local user): use {flag}-file or {env}",
    )


def _add_listen_options(
    p: argparse.ArgumentParser, worker_default: tuple[str, int], worker_help: str
) -> None:
    """--http and --worker-listen: where a broker serves the API and its workers."""
    p.add_argument("--http", type=_host_port, default=("127.0.0.1", 8080), metavar="HOST:PORT")
    p.add_argument(
        "--worker-listen",
        type=_host_port,
        default=worker_default,
        metavar="HOST:PORT",
        help=worker_help,
    )


def _add_broker_options(p: argparse.ArgumentParser) -> None:
    """Options every kind of broker takes (standalone and cluster)."""
    _add_path_option(
        p,
        "--worker-token-file",
        "STEWARD_WORKER_TOKEN_FILE",
        "the workers' shared token (legacy, unscoped; prefer worker credentials: "
        "steward token create NAME --worker), first line of this file (env "
        "STEWARD_WORKER_TOKEN_FILE, or the token itself in STEWARD_WORKER_TOKEN)",
    )
    _add_deprecated_secret_option(p, "--worker-token", "STEWARD_WORKER_TOKEN")
    _add_path_option(
        p,
        "--admin-token-file",
        "STEWARD_ADMIN_TOKEN_FILE",
        "turn authentication on: every API call needs a token, and the token in this "
        "file is an admin one (env STEWARD_ADMIN_TOKEN_FILE, or the token itself in "
        "STEWARD_ADMIN_TOKEN)",
    )
    _add_path_option(
        p,
        "--cluster-token-file",
        "STEWARD_CLUSTER_TOKEN_FILE",
        "the brokers' shared secret for snapshot and code downloads between them, "
        "first line of this file (env STEWARD_CLUSTER_TOKEN_FILE, or the secret itself in "
        "STEWARD_CLUSTER_TOKEN)",
    )
    _add_deprecated_secret_option(p, "--cluster-token", "STEWARD_CLUSTER_TOKEN")
    p.add_argument("--heartbeat-interval-ms", type=int, default=1000)
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=10_000,
        help="a worker silent or disconnected this long is declared dead (default %(default)s)",
    )
    p.add_argument("--snapshot-interval-s", type=float, default=60.0)
    p.add_argument("--ledger-roll-mb", type=float, default=64.0)
    _add_edge_options(p)
    _add_log_format_option(p)
    p.add_argument("--log-level", default="INFO")
    _add_tls_options(p, "", "to verify other brokers with, passed on to child workers")


def _add_edge_options(p: argparse.ArgumentParser) -> None:
    """Bounds on what a client or a would-be worker may make the broker hold or wait for."""
    p.add_argument(
        "--http-header-timeout-s",
        type=float,
        default=10.0,
        metavar="S",
        help="a request's line and headers must arrive within this (408 after; "
        "default %(default)s)",
    )
    p.add_argument(
        "--http-body-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="a request body must arrive within this, plus 1 s per 64 KiB received "
        "(408 after; default %(default)s)",
    )
    p.add_argument(
        "--http-max-connections",
        type=int,
        default=1024,
        metavar="N",
        help="HTTP connections served at once; more are answered 503 (default %(default)s)",
    )
    p.add_argument(
        "--worker-hello-timeout-s",
        type=float,
        default=5.0,
        metavar="S",
        help="a connection to the worker port must send its hello within this "
        "(default %(default)s)",
    )
    p.add_argument(
        "--worker-max-unauthenticated",
        type=int,
        default=64,
        metavar="N",
        help="worker-port connections before their hello is accepted; more are refused "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-task-output-mb",
        type=float,
        default=256.0,
        metavar="MB",
        help="task output (steward logs) the leader keeps in memory in total, the oldest "
        "attempt's evicted first; each attempt keeps its last 1 MiB (default %(default)s)",
    )


def _add_tls_options(p: argparse.ArgumentParser, scope: str, ca_use: str) -> None:
    """--tls-cert/--tls-key/--tls-ca of a broker (``scope`` prefixes the help texts)."""
    p.add_argument(
        "--tls-cert",
        type=Path,
        metavar="PATH",
        help=f"{scope}PEM certificate (chain): serve HTTPS and TLS to workers (needs --tls-key)",
    )
    p.add_argument(
        "--tls-key", type=Path, metavar="PATH", help=f"{scope}PEM private key of --tls-cert"
    )
    _add_path_option(
        p,
        "--tls-ca",
        CA_ENV,
        f"{scope}CA bundle {ca_use} (env {CA_ENV}; default: the system trust store)",
    )


def _tls_config(args: argparse.Namespace) -> TlsConfig | None:
    try:
        return TlsConfig.from_options(args.tls_cert, args.tls_key, args.tls_ca)
    except TlsConfigError as exc:
        raise UsageError(str(exc)) from None


def _add_log_format_option(p: argparse.ArgumentParser) -> None:
    from broker.observability.logs import add_log_format_option

    add_log_format_option(p)
