"""``python -m tests.jepsen --seed N --faults K [--ledger file|pulsar|apache-pulsar]
[--kinds K1,K2]``: one Jepsen run
(``--check DIR``: re-check a kept run's history; ``--ci``: the CI-sized configuration, one
run per ledger backend, :data:`CI_FAULTS` faults each).

Makes the network (tests/jepsen/netns.py: namespaces on a bridge, a leftover of a killed
run removed first), runs the driver (tests/jepsen/run.py) inside the control namespace,
and tears every namespace, link and process down on every exit (also ^C or a failure).
Exit status: 0 the checker passed, 1 it found violations (the report is printed), 2 the
run could not be made. docs/TESTING.md ("Partitions") describes the fault model.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.jepsen.checker import check, report
from tests.jepsen.history import History
from tests.jepsen.nemesis import ALL_KINDS, KINDS_NEEDING
from tests.jepsen.netns import Network, NetworkError
from tests.jepsen.run import LEDGERS, nodes

# Most of one round of the schedule each (tests/jepsen/nemesis.py: every network kind
# twice, every other kind once, interleaved in proportion): 15 network and 11 process or
# clock faults per backend, 30 and 22 in all, in under 10 minutes.
CI_FAULTS = {"file": 26, "pulsar": 26}


def recheck(path: Path) -> int:
    try:
        history = History.load(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"cannot read {path}: {exc}", file=sys.stderr)
        return 2
    violations = check(history)
    print(report(history, violations) if violations else f"checker passed: {path}")
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.jepsen", description=__doc__)
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--check", type=Path, metavar="DIR", help="re-check DIR/history.jsonl of a kept run"
    )
    parser.add_argument("--faults", type=int, default=10, help="faults injected (default 10)")
    parser.add_argument(
        "--ledger",
        choices=LEDGERS,
        default="file",
        help="the brokers' ledger backend (pulsar: pulsar-lite in a namespace of its own; "
        "apache-pulsar: a real Apache Pulsar cluster, its broker and three bookies each in a "
        "namespace of its own, from ./scripts/fetch-engines)",
    )
    parser.add_argument(
        "--kinds",
        default="",
        metavar="K1,K2",
        help="only these fault kinds (default: every kind; tests/jepsen/nemesis.py names them)",
    )
    parser.add_argument(
        "--ci",
        action="store_true",
        help="the CI-sized configuration: one run per ledger backend (--faults, --ledger unused)",
    )
    parser.add_argument("--dir", type=Path, help="logs and history (default: a new temp dir)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="bound of the whole run")
    parser.add_argument("--session-timeout-ms", type=int, default=4000)
    parser.add_argument(
        "--max-attempts", type=int, default=10, help="the submitted tasks' max_attempts"
    )
    args = parser.parse_args(argv)
    # SIGTERM (a CI timeout, ``kill``) unwinds as ^C does: the driver is killed and every
    # namespace, link and process removed (Network.__exit__), the host lock released.
    signal.signal(signal.SIGTERM, _terminated)
    if args.check is not None:
        return recheck(args.check / "history.jsonl")
    if args.seed is None:
        parser.error("--seed is required (or --check DIR)")
    if args.faults < 0 or args.timeout_s <= 0 or args.max_attempts < 1:
        parser.error("--faults must be >= 0, --timeout-s > 0 and --max-attempts >= 1")
    unknown = set(args.kinds.split(",")) - set(ALL_KINDS) if args.kinds else set()
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(ALL_KINDS)}")
    for kind in args.kinds.split(",") if args.kinds and not args.ci else ():
        if args.ledger not in KINDS_NEEDING.get(kind, LEDGERS):
            parser.error(f"fault kind {kind} needs --ledger {' or '.join(KINDS_NEEDING[kind])}")
    directory = args.dir or Path(tempfile.mkdtemp(prefix="steward-jepsen-"))
    if not args.ci:
        return one_run(args, directory, args.ledger, args.faults)
    # Task processes run under other uids (docs/SECURITY.md, "Task users"): they must
    # traverse to each run's directory below this one (mkdtemp makes it 0700).
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, os.stat(directory).st_mode | 0o711)
    results = {}
    for ledger, faults in CI_FAULTS.items():
        results[ledger] = one_run(args, directory / ledger, ledger, faults)
    print(f"jepsen CI seed {args.seed}: exit status by ledger {results}", flush=True)
    return max(results.values())


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def one_run(args: argparse.Namespace, directory: Path, ledger: str, faults: int) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    print(f"jepsen seed {args.seed} ({ledger}): logs and history in {directory}", flush=True)
    try:
        with Network(nodes(ledger)) as net:
            command = [
                *net.exec_prefix("ctl"), sys.executable, "-m", "tests.jepsen.run",
                "--dir", str(directory), "--seed", str(args.seed),
                "--faults", str(faults), "--ledger", ledger,
                "--duration-s", str(args.timeout_s),
                "--session-timeout-ms", str(args.session_timeout_ms),
                "--max-attempts", str(args.max_attempts),
                *(["--kinds", args.kinds] if args.kinds else []),
            ]  # fmt: skip
            try:
                return subprocess.run(command, timeout=args.timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                print(f"the run did not end within {args.timeout_s} s", file=sys.stderr)
                return 2
    except NetworkError as exc:
        print(f"cannot make the network: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
