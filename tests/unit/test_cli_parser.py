"""The ``steward`` parser's conventions (issue 17): client options anywhere, a help text
with its default on every option, choices for --state, ``cluster`` split into ``status``
and ``up``, no abbreviations, ``--version``; and the built-in task types' params check."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from broker.core.transitions import TaskState
from broker.core.validation import BUILTIN_PARAMS, validate_builtin_params
from clients.cli import main
from clients.cli.flag_docs import _commands
from clients.cli.options import TASK_STATES, StewardArgumentParser
from clients.cli.output import cell
from clients.cli.parser import build_parser
from clients.worker.task_api import BUILTIN_TASKS

if TYPE_CHECKING:
    from log.pulsar import PulsarConfig

URL_A = "http://127.0.0.1:1"
URL_B = "http://127.0.0.1:2"


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    return [
        (name, p) for name, p in _commands(build_parser(), "steward") if name != "steward worker"
    ]


@pytest.mark.parametrize(
    ("argv", "url", "token"),
    [
        (["tasks"], "http://127.0.0.1:8080", None),
        (["--url", URL_A, "tasks"], URL_A, None),
        (["tasks", "--url", URL_A], URL_A, None),
        (["--token", "t", "tasks", "--url", URL_A], URL_A, "t"),
        (["--url", URL_A, "tasks", "--url", URL_B], URL_B, None),  # the later one wins
        (["code", "list", "--token", "t", "--url", URL_B], URL_B, "t"),
        (["cluster", "status", "--url", URL_A], URL_A, None),
    ],
)
def test_client_options_go_before_or_after_the_command(
    argv: list[str], url: str, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STEWARD_URL", raising=False)
    monkeypatch.delenv("STEWARD_TOKEN", raising=False)
    args = build_parser().parse_args(argv)
    assert (args.url, args.token) == ([url], token)


def test_every_argument_has_a_help_text_and_every_help_shows_defaults_not_reprs() -> None:
    for name, parser in _parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{name} {action.dest}: no help text"
        text = parser.format_help()
        for repr_fragment in ("('", "{'", "[]", "None", "True", "False"):
            assert repr_fragment not in text, f"{name} --help shows {repr_fragment!r}:\n{text}"
        formatter = parser._get_formatter()
        for action in parser._actions:
            shown = action.default not in (None, False, [], argparse.SUPPRESS)
            if action.option_strings and shown and action.help != argparse.SUPPRESS:
                # "... (default X)" added by the formatter, or the help's own words.
                expanded = formatter._expand_help(action)
                assert "default" in expanded, (name, action.option_strings, expanded)
    standalone = dict(_parsers())["steward standalone"].format_help()
    assert "default 127.0.0.1:7070" in standalone  # a tuple default as typed


def test_the_top_help_documents_the_environment_and_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = build_parser().format_help()
    assert "STEWARD_URL" in text and "STEWARD_TOKEN" in text
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert re.fullmatch(r"steward \S+ \(Python 3\.\d+\.\d+\)\n", capsys.readouterr().out)


def test_state_choices_are_the_brokers_task_states(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(TASK_STATES) == {s.value for s in TaskState}
    with pytest.raises(SystemExit) as exited:
        main(["tasks", "--state", "runing"])
    assert exited.value.code == 2
    assert "invalid choice: 'runing'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["tasks", "--lim", "3"], ["tasks", "--bogus"], ["frobnicate"]])
def test_unknown_and_abbreviated_options_and_commands_are_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "--help" in capsys.readouterr().err  # says where to look


def test_cluster_takes_an_action_and_cluster_up_renamed_brokers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["cluster", "--brokers=3"]) == 2
    err = capsys.readouterr().err
    assert "cluster up --broker-count" in err and "cluster status" in err
    with pytest.raises(SystemExit) as exited:
        main(["cluster", "--brokers", "3", "--data-dir", "/nonexistent"])
    assert exited.value.code == 2
    assert "cluster up --broker-count" in capsys.readouterr().err
    up = build_parser().parse_args(["cluster", "up", "--broker-count", "5"])
    assert (up.broker_count, up.brokers_deprecated) == (5, None)
    old = build_parser().parse_args(["cluster", "up", "--brokers", "5"])
    assert old.brokers_deprecated == 5  # still accepted, with a warning (servers.py)
    assert "--brokers" not in dict(_parsers())["steward cluster up"].format_help()


def test_subcommand_parsers_share_the_conventions() -> None:
    for name, parser in _parsers():
        assert isinstance(parser, StewardArgumentParser), name
        assert parser.allow_abbrev is False, name


def test_human_cells_show_no_python_reprs() -> None:
    assert cell({"cpu": 2.0, "memory_mb": 512.5}) == "cpu=2, memory_mb=512.5"
    assert (cell(True), cell(False), cell(None), cell([]), cell(["a", "b"])) == (
        "yes",
        "no",
        "-",
        "-",
        "a, b",
    )


def test_the_broker_checks_the_params_of_every_built_in_task_type() -> None:
    # noop takes any params (a payload); every other built-in has its keys listed.
    assert set(BUILTIN_PARAMS) | {"noop"} == set(BUILTIN_TASKS)
    problem = validate_builtin_params("sleep", b'{"secs": 1}')
    assert problem is not None and "'secs'" in problem and "allowed keys: seconds" in problem
    assert validate_builtin_params("sleep", b'{"seconds": 1}') is None
    assert validate_builtin_params("sleep", b"null") is None
    assert "number >= 0" in (validate_builtin_params("sleep", b'{"seconds": -1}') or "")
    assert "number >= 0" in (validate_builtin_params("sleep", b'{"seconds": true}') or "")
    assert "JSON object" in (validate_builtin_params("fail", b"[1]") or "")
    assert validate_builtin_params("fail", b'{"message": "boom"}') is None
    assert "query" in (validate_builtin_params("spark.sql", b"{}") or "")
    assert validate_builtin_params("spark.sql", b'{"query": "SELECT 1", "max_rows": 5}') is None
    assert "max_rows" in (
        validate_builtin_params("spark.sql", b'{"query": "x", "max_rows": 1.5}') or ""
    )
    assert validate_builtin_params("noop", b'{"anything": [1, 2]}') is None
    assert validate_builtin_params("mod:fn", b'{"secs": 1}') is None


def test_cancel_takes_an_id_or_filters() -> None:
    one = build_parser().parse_args(["cancel", "5"])
    assert one.id == 5 and one.tenant is None
    bulk = build_parser().parse_args(["cancel", "--tenant", "acme", "--state", "waiting"])
    assert bulk.id is None and (bulk.tenant, bulk.state) == ("acme", "waiting")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cancel", "--state", "finished"])  # not a live state


def test_the_broker_hands_pulsar_tls_files_to_the_client_and_checks_them(
    tmp_path: Path,
) -> None:
    from clients.cli.options import UsageError
    from clients.cli.servers import _pulsar_config

    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in files.values():
        path.write_text("PEM")
    base = ["broker", "--zookeeper", "zk:2181", "--broker-id", "b", "--data-dir", str(tmp_path)]
    base += ["--ledgers", "pulsar"]
    base += ["--pulsar-url", "pulsar+ssl://pulsar:6651"]

    def config(*extra: str) -> PulsarConfig | None:
        return _pulsar_config(build_parser().parse_args([*base, *extra]))

    tls = ["--pulsar-tls-ca-file", str(files["ca"]), "--pulsar-tls-cert-file", str(files["cert"])]
    chosen = config(*tls, "--pulsar-tls-key-file", str(files["key"]))
    assert chosen is not None
    assert chosen.tls_trust_certs_file == str(files["ca"])
    assert chosen.tls_certificate_file == str(files["cert"])
    assert chosen.tls_private_key_file == str(files["key"])
    plain = config()
    assert plain is not None and plain.tls_trust_certs_file is None
    with pytest.raises(UsageError, match=r"--pulsar-tls-ca-file .*: no such file"):
        config("--pulsar-tls-ca-file", str(tmp_path / "missing.pem"))
    with pytest.raises(UsageError, match="together"):
        config(*tls)
