"""The ``steward`` command line (the console script ``steward = clients.cli:main``).

Layout: :mod:`.options` (argument types, shared option groups, defaults), :mod:`.parser`
(every command's options), :mod:`.client_commands` (the commands that call a broker's API),
:mod:`.output` (how their answers are printed), :mod:`.servers` (``standalone``, ``broker``,
``cluster up``: run here); ``main`` below dispatches and turns errors into exit statuses.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from broker.security.tls import CA_ENV, TlsConfigError
from clients.cli.client_commands import run_client_command
from clients.cli.options import DEFAULT_FAILOVER_TIMEOUT_S, DEFAULT_URL, UsageError
from clients.cli.output import tree_status
from clients.cli.parser import build_parser
from clients.cli.servers import _auth_config, run_broker, run_cluster_up, run_standalone
from clients.client import CertificateVerifyError, StewardError

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "standalone":
            return run_standalone(args)
        if args.command == "broker":
            return run_broker(args)
        if args.command == "cluster" and args.action == "up":
            return run_cluster_up(args)
        if args.command == "worker":
            from clients.worker.__main__ import main as worker_main

            return worker_main(args.worker_args)
        if args.command == "demo":
            from clients.demo.run import run_demo

            return run_demo(keep=args.keep)
        return run_client_command(args)
    except CertificateVerifyError as exc:
        print(
            f"steward: {exc} (give the CA bundle that signed the broker's certificate with "
            f"--ca-file or {CA_ENV})",
            file=sys.stderr,
        )
        return 1
    except StewardError as exc:
        print(f"steward: {exc}", file=sys.stderr)
        return 1
    except (UsageError, TlsConfigError) as exc:
        print(f"steward: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
