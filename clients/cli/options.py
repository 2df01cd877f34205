"""Argument types and the option groups several commands share (broker, HTTP edge, TLS,
log format options), the CLI's defaults and its usage error."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Final, NoReturn

from broker.security.tls import CA_ENV, TlsConfig, TlsConfigError
from clients.client import (
    parse_urls,
)

DEFAULT_URL = "http://127.0.0.1:8080"
# Shorter than the library's 30 s: someone is waiting at the terminal.
DEFAULT_FAILOVER_TIMEOUT_S = 10.0
#: The task states a listing filters by (the broker's TaskState values; the CLI may not
#: import the state machine: tests/unit/test_cli_parser.py checks they agree).
TASK_STATES: Final = ("pending", "delayed", "waiting", "running", "finished", "error", "cancelled")


class UsageError(Exception):
    pass


class NotStewardError(Exception):
    """The URL answered, but not as a Steward broker does (``got``: what it answered)."""

    def __init__(self, got: str) -> None:
        super().__init__(got)
        self.got = got


# A week: long enough for a weekly job's artifact to survive between its runs.
DEFAULT_CODE_RETENTION_H: Final = 168.0


def shown_default(value: object) -> str:
    """A default as a user types it: (host, port) as host:port, (low, high) as low-high,
    a list as A,B; never a Python repr."""
    if isinstance(value, tuple) and len(value) == 2:
        first, second = value
        if isinstance(first, str) and isinstance(second, int):
            return f"{first}:{second}"
        if isinstance(first, int) and isinstance(second, int):
            return f"{first}-{second}"
    if isinstance(value, list | tuple):
        return ",".join(shown_default(v) for v in value)
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every help names its default (as a user types it) unless it says it already, and
    a choice option lists its choices the same way (A, B: not a Python set); descriptions
    and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        has_default = not (default is None or default is False or default == [])
        has_default = has_default and default is not argparse.SUPPRESS
        if has_default and "default" not in text and action.option_strings:
            text += " (default %(default)s)"
        return text

    def _expand_help(self, action: argparse.Action) -> str:
        params: dict[str, Any] = {**vars(action), "prog": self._prog}
        params["default"] = shown_default(action.default)
        if action.choices is not None:
            params["choices"] = ", ".join(str(c) for c in action.choices)
        return (self._get_help_string(action) or "") % params


class StewardArgumentParser(argparse.ArgumentParser):
    """No abbreviated options (``--work`` is an error, not ``--workers``) and the help
    formatter above, for the parser and every subcommand's."""

    #: What to do instead, added to every usage error of this (sub)command.
    usage_hint: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        hint = self.usage_hint or f"see {self.prog} --help"
        self.exit(2, f"{self.prog}: error: {message} ({hint})\n")

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        """An option's value that does not convert (bad JSON, a word for a number) is a
        bad value, not a misuse of the command: one line saying what is wrong, no usage."""
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as exc:
            name = exc.argument_name or action.dest
            self.exit(2, f"steward: {name}: {exc.message} (see {self.prog} --help)\n")


def add_client_options(p: argparse.ArgumentParser, *, top: bool = False) -> None:
    """--url, --token, --failover-timeout-s and --ca-file: on the top parser with their
    defaults, and on every client command with none (argparse.SUPPRESS) so that they may
    come after the command too without resetting what came before it."""

    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    p.add_argument(
        "--url",
        type=_broker_urls,
        default=default(os.environ.get("STEWARD_URL", DEFAULT_URL)),
        metavar="URL[,URL...]",
        help="the broker's HTTP URL, or a comma-separated list of a cluster's brokers "
        f"(any of them: writes find the leader) (env STEWARD_URL; default {DEFAULT_URL})",
    )
    p.add_argument(
        "--token",
        default=default(os.environ.get("STEWARD_TOKEN")),
        help="API token sent with every call (env STEWARD_TOKEN; default: none, for a "
        "broker without authentication)",
    )
    p.add_argument(
        "--failover-timeout-s",
        type=_positive_seconds,
        default=default(os.environ.get("STEWARD_FAILOVER_TIMEOUT_S", DEFAULT_FAILOVER_TIMEOUT_S)),
        metavar="S",
        help="how long a write keeps trying other brokers or waits for a leader "
        f"(env STEWARD_FAILOVER_TIMEOUT_S; default {DEFAULT_FAILOVER_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--ca-file",
        type=Path,
        default=default(os.environ.get(CA_ENV)),
        metavar="PATH",
        help=f"CA bundle to verify https:// brokers with (env {CA_ENV}; default: the "
        "system trust store)",
    )


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", action="store_true", help="print the broker's answer as JSON (for scripts)"
    )


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
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({exc}): write it in single quotes for the shell, with double"
            """ quotes inside, e.g. '{"seconds": 1}'"""
        ) from None


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
    p.add_argument(
        "--http",
        type=_host_port,
        default=("127.0.0.1", 8080),
        metavar="HOST:PORT",
        help="where the HTTP API, the dashboard and /metrics listen (port 0 picks a free one)",
    )
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
    p.add_argument(
        "--code-retention-h",
        type=float,
        default=DEFAULT_CODE_RETENTION_H,
        metavar="H",
        help="delete code artifacts no task has needed for this many hours, from every "
        "broker and worker cache (default %(default)s; 0: keep forever)",
    )
    p.add_argument(
        "--heartbeat-interval-ms",
        type=int,
        default=1000,
        metavar="MS",
        help="how often the broker and its workers exchange heartbeats",
    )
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=10_000,
        metavar="MS",
        help=(
            "a worker silent or disconnected this long is declared dead; longer with over "
            "3,333 workers: three heartbeat intervals at 1,000 heartbeats a second "
            "(default %(default)s)"
        ),
    )
    p.add_argument(
        "--snapshot-interval-s",
        type=float,
        default=60.0,
        metavar="S",
        help="write a snapshot of the state this often (recovery replays the log after it)",
    )
    p.add_argument(
        "--ledger-roll-mb",
        type=float,
        default=64.0,
        metavar="MB",
        help="start a new ledger (log segment) once the current one holds this much",
    )
    _add_edge_options(p)
    _add_log_format_option(p)
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="least severe log records written to stderr: %(choices)s",
    )
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
        help="worker-port connections before their hello is accepted; one over the cap waits up to "
        "3 s for a slot, then is refused (default %(default)s)",
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
