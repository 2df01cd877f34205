"""Issue 17, frictions 4, 5 and 12 (the CLI's conventions), through the real ``steward``
command against a real standalone broker with a real worker.

Each friction as a newcomer meets it: the exit code, the key words of the one line that
says what to do instead, no traceback, and a bounded time. One broker and one worker
(sleep, noop, fail: no Spark) serve the module; every CLI call runs with a timeout.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli_runs import CLI_TIMEOUT_S, one_line_error, steward
from tests.support.procs import HOST, BrokerProcess, free_port, steward_command
from tests.support.worker_procs import broker_with_worker

# A wrong URL is answered at once (no retry loop): well under the CLI timeout.
WRONG_URL_BOUND_S = 15.0


@dataclass(frozen=True)
class Setup:
    broker: BrokerProcess
    worker_port: int

    @property
    def url(self) -> str:
        return self.broker.url


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("newcomer-cli")
    types = ("--task-type", "sleep=2", "--task-type", "noop=2", "--task-type", "fail=1")
    with broker_with_worker(root, "newcomer-worker", types) as (broker, worker):
        yield Setup(broker, int(worker.broker.rpartition(":")[2]))


# --- friction 5: --url anywhere, env documented, help shows defaults -----------------------


def test_client_options_go_anywhere_on_the_command_line(setup: Setup) -> None:
    before = steward("--url", setup.url, "whoami", "--json")
    after = steward("whoami", "--json", "--url", setup.url)
    assert before.code == after.code == 0, (before, after)
    assert json.loads(before.out) == json.loads(after.out)
    from_env = steward("whoami", "--json", env={"STEWARD_URL": setup.url})
    assert from_env.code == 0 and json.loads(from_env.out)["role"] == "admin", from_env


def test_help_names_the_environment_defaults_and_choices() -> None:
    top = steward("--help")
    assert top.code == 0 and "STEWARD_URL" in top.out and "STEWARD_TOKEN" in top.out
    standalone = steward("standalone", "--help")
    assert "default 127.0.0.1:7070" in standalone.out  # not ('127.0.0.1', 7070)
    assert "('" not in standalone.out and "None" not in standalone.out
    tasks = steward("tasks", "--help")
    words = " ".join(tasks.out.split())  # the help wraps its lines
    assert "pending, delayed, waiting, running, finished, error, cancelled" in words
    assert "(default 50)" in words
    version = steward("--version")
    assert version.code == 0 and version.out.startswith("steward "), version


# --- friction 5: a wrong URL or port says so in one line ----------------------------------


class _NotSteward(http.server.BaseHTTPRequestHandler):
    """A web server that is not Steward: 404 pages, and a 200 page under /ok/."""

    def do_GET(self) -> None:
        body = b"<html><body>Not Found</body></html>"
        self.send_response(200 if self.path.startswith("/ok/") else 404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def web_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer((HOST, 0), _NotSteward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_wrong_url_says_no_steward_broker_and_what_it_got(setup: Setup, web_server: str) -> None:
    nobody = f"http://{HOST}:{free_port()}"
    cases = [
        (nobody, "connection refused"),
        (web_server, "HTTP 404"),
        (f"{web_server}/ok", "not Steward's JSON API"),
        (f"http://{HOST}:{setup.worker_port}", "worker port"),
        (setup.url.replace("http://", "https://"), "TLS error"),
    ]
    for url, got in cases:
        # A write keeps trying for --failover-timeout-s (a broker may be restarting); the
        # same one line ends it.
        for command in (("tasks",), ("submit", "noop", "--failover-timeout-s", "2")):
            run = steward("--url", url, *command)
            message = one_line_error(run, 1, f"no Steward broker at {url}", got, "--url")
            assert run.out == "", run
            assert run.elapsed_s < WRONG_URL_BOUND_S, (message, run.elapsed_s)
            assert "<html>" not in message
            if command[0] == "submit" and got in ("connection refused", "worker port"):
                # Said at once, before the write's retries: the first line.
                first = run.err.splitlines()[0]
                assert first.startswith(f"steward: nothing answers at {url}"), run
                assert "--failover-timeout-s" in first, run


# --- friction 5: a closed stdout ends quietly ----------------------------------------------


def test_a_closed_stdout_ends_quietly(setup: Setup) -> None:
    # A type no worker serves (asked to: they wait), so they stay for the listing below.
    made = steward(
        "--url", setup.url, "submit", "pipe", "--tenant", "nc-pipe", "--count", "400",
        "--allow-unknown-type",
    )  # fmt: skip
    assert made.code == 0, made
    # More than a pipe's buffer of JSON: the writer meets the closed pipe.
    proc = subprocess.Popen(
        [*steward_command(), "--url", setup.url, "tasks", "--json", "--limit", "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"{"  # like `| head -1`
    proc.stdout.close()
    try:
        code = proc.wait(timeout=CLI_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert code in (0, 141), (code, err)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# --- friction 5: built-in task types check their params ------------------------------------


def test_a_misspelt_builtin_param_is_a_400_naming_the_allowed_keys(setup: Setup) -> None:
    run = steward("--url", setup.url, "submit", "sleep", "--params", '{"secs": 1}')
    one_line_error(run, 1, "'secs'", "allowed keys: seconds", "400")
    run = steward("--url", setup.url, "submit", "spark.sql", "--params", '{"sql": "SELECT 1"}')
    one_line_error(run, 1, "allowed keys: query, max_rows", "400")


# --- friction 5 and 12: readable output, --json on reads, hints on stderr ------------------


def test_submit_wait_prints_a_readable_outcome(setup: Setup) -> None:
    slept = steward(
        "--url", setup.url, "submit", "sleep", "--params", '{"seconds": 0}', "--wait",
        "--timeout-s", "60",
    )  # fmt: skip
    assert slept.code == 0, slept
    assert slept.out.startswith("task ") and slept.out.endswith(" finished: result slept=0\n")
    noop = steward("--url", setup.url, "submit", "noop", "--wait", "--timeout-s", "60")
    assert noop.code == 0 and noop.out.endswith(" finished\n"), noop  # not "finished null"
    failed = steward("--url", setup.url, "submit", "fail", "--wait", "--timeout-s", "60")
    assert failed.code == 1 and " error: " in failed.out, failed
    as_json = steward("--url", setup.url, "submit", "noop", "--wait", "--json")
    assert as_json.code == 0 and json.loads(as_json.out)[0]["state"] == "finished", as_json


@pytest.mark.parametrize(
    "command",
    [
        ("status",),
        ("cluster", "status"),
        ("whoami",),
        ("tenant", "default"),
        ("tasks",),
        ("task", "1"),
        ("digest",),
        ("code", "list"),
        ("token", "list"),
    ],
)
def test_every_read_is_human_by_default_and_json_with_json(
    setup: Setup, command: tuple[str, ...]
) -> None:
    human = steward("--url", setup.url, *command)
    if command == ("token", "list"):
        # Without authentication there are no tokens to list: the broker says so.
        assert human.code in (0, 1), human
    else:
        assert human.code == 0, human
        for python_repr in ("{'", "('", "True", "False", "None", '{"'):
            assert python_repr not in human.out, (python_repr, human.out)
    machine = steward("--url", setup.url, *command, "--json")
    if human.code == 0:
        assert machine.code == 0, machine
        json.loads(machine.out)


def test_the_paging_hint_goes_to_stderr(setup: Setup) -> None:
    run = steward("--url", setup.url, "tasks", "--limit", "1")
    assert run.code == 0 and len(run.out.splitlines()) == 2, run  # header and one row
    assert "--after" in run.err, run


# --- friction 4 and 12: cluster split, unknown commands and flags are errors ---------------


def test_cluster_is_status_or_up_and_flags_without_up_are_errors() -> None:
    for args in (("cluster", "--brokers", "3"), ("cluster", "--brokers=5"), ("cluster",)):
        run = steward(*args, "--data-dir", "/nonexistent")
        one_line_error(run, 2, "cluster up --broker-count", "cluster status")
        assert run.out == "", run
    for args in (("frobnicate",), ("tasks", "--bogus"), ("tasks", "--lim", "3")):
        one_line_error(steward(*args), 2, "--help")
    one_line_error(steward("tasks", "--state", "runing"), 2, "invalid choice")


# --- friction 12: --worker-token only when a worker uses it --------------------------------


def test_standalone_with_an_admin_token_and_no_workers_starts(tmp_path: Path) -> None:
    admin = tmp_path / "admin-token"
    admin.write_text("newcomer-admin-token\n")
    with BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "broker.log",
        extra_args=("--admin-token-file", str(admin)),
    ) as broker:
        broker.start()
        refused = steward("--url", broker.url, "whoami")
        one_line_error(refused, 1, "401")
        who = steward("--url", broker.url, "--token", "newcomer-admin-token", "whoami")
        assert who.code == 0 and "admin" in who.out, who
