"""The ``steward`` command line (the console script ``steward = clients.cli:main``).

Layout: :mod:`.options` (argument types, shared option groups, defaults), :mod:`.parser`
(every command's options), :mod:`.client_commands` (the commands that call a broker's API),
:mod:`.output` (how their answers are printed), :mod:`.waiting` (what a wait says while
it waits and on Ctrl-C), :mod:`.servers` (``standalone``, ``broker``,
``cluster up``: run here); ``main`` below dispatches and turns errors into exit statuses.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from broker.security.tls import CA_ENV, TlsConfigError
from clients.cli.client_commands import run_client_command
from clients.cli.options import (
    DEFAULT_FAILOVER_TIMEOUT_S,
    DEFAULT_URL,
    NotStewardError,
    UsageError,
)
from clients.cli.output import tree_status, unreachable_reason
from clients.cli.parser import CLUSTER_HINT, build_parser
from clients.cli.servers import _auth_config, run_broker, run_cluster_up, run_standalone
from clients.client import (
    CertificateVerifyError,
    ConnectionFailedError,
    FailoverTimeoutError,
    StewardError,
)

__all__ = [
    "DEFAULT_FAILOVER_TIMEOUT_S",
    "DEFAULT_URL",
    "UsageError",
    "_auth_config",
    "build_parser",
    "main",
    "run_broker",
    "run_client_command",
    "run_cluster_up",
    "run_standalone",
    "tree_status",
]


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args, extra = parser.parse_known_args(argv)
    if args.command == "cluster" and args.cluster_command is None:
        # `cluster` was both a read and the launcher's group: flags without `up` were
        # silently ignored. Now each action is named.
        given = f" {' '.join(extra)}" if extra else ""
        raise UsageError(f"`steward cluster{given}` does nothing: {CLUSTER_HINT}")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _no_broker(urls: Sequence[str], got: str) -> str:
    where = ",".join(urls)
    return (
        f"no Steward broker at {where} (got {got}): give a broker's HTTP URL with --url "
        "or STEWARD_URL (steward standalone prints it: http://HOST:PORT)"
    )


def _not_a_broker(urls: Sequence[str], exc: StewardError) -> str | None:
    """The one line for an error that means nothing Steward answered at ``urls``, or None
    (a write gives up after --failover-timeout-s: its last error says why)."""
    if isinstance(exc, FailoverTimeoutError):
        return _not_a_broker(urls, exc.last_error)
    if isinstance(exc, CertificateVerifyError):
        return None
    if isinstance(exc, ConnectionFailedError):
        return _no_broker(urls, unreachable_reason(exc))
    if exc.code == "http_error":  # an error answer that is not the API's JSON
        return _no_broker(urls, f"HTTP {exc.status}")
    return None


def _run(args: argparse.Namespace) -> int:
    if args.command == "standalone":
        return run_standalone(args)
    if args.command == "broker":
        return run_broker(args)
    if args.command == "cluster" and args.cluster_command == "up":
        return run_cluster_up(args)
    if args.command == "worker":
        from clients.worker.__main__ import main as worker_main

        return worker_main(args.worker_args)
    if args.command == "demo":
        from clients.demo.run import run_demo

        return run_demo(keep=args.keep)
    return run_client_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = _parse(parser, argv)
        code = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader went away (`steward tasks | head -1`): end quietly, as cat does. Point
        # stdout at /dev/null so the interpreter's final flush cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by it
    except CertificateVerifyError as exc:
        print(
            f"steward: {exc} (give the CA bundle that signed the broker's certificate with "
            f"--ca-file or {CA_ENV})",
            file=sys.stderr,
        )
        return 1
    except NotStewardError as exc:
        print(f"steward: {_no_broker(args.url, exc.got)}", file=sys.stderr)
        return 1
    except StewardError as exc:
        print(f"steward: {_not_a_broker(args.url, exc) or exc}", file=sys.stderr)
        return 1
    except (UsageError, TlsConfigError) as exc:
        print(f"steward: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
