"""Where a worker connects and what it says when it cannot (issue 17, frictions 1 and 8):
``--broker`` parsing, telling a misconfiguration from a failure that may heal, the
logging of repeated failures, giving up, and the broker's port-clash message."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from broker.api.api_models import ClusterSummary
from broker.replication.node import BrokerStartupError
from broker.server.standalone import HTTP_PORT, WORKER_PORT, check_port_free
from clients.cli.options import _host_port
from clients.worker.config import WorkerConfig, parse_broker_option, parse_host_port
from clients.worker.link.discovery import (
    BrokerError,
    LeaderUnknownError,
    LinkMisconfiguredError,
    Problems,
    find_leader,
    refusal,
    sniff_answer,
)
from clients.worker.link.worker_link import Worker

WAIT_S = 20.0


def test_broker_option_takes_urls_or_a_worker_endpoint() -> None:
    assert parse_broker_option("http://a:8080") == ("", ["http://a:8080"])
    assert parse_broker_option("http://a:1, https://b:2/") == ("", ["http://a:1", "https://b:2"])
    assert parse_broker_option("127.0.0.1:7070") == ("127.0.0.1:7070", [])
    with pytest.raises(ValueError, match=r"HTTP URL \(http://HOST:PORT\) or a worker endpoint"):
        parse_broker_option("localhost")
    with pytest.raises(ValueError, match="a list must be of the brokers' HTTP URLs"):
        parse_broker_option("a:1,b:2")
    with pytest.raises(ValueError, match="write http://a:1"):
        parse_broker_option("http://b:2,a:1")


def test_a_url_where_host_port_is_wanted_says_what_to_write() -> None:
    with pytest.raises(ValueError, match=re.escape("write '127.0.0.1:7070' without http://")):
        parse_host_port("http://127.0.0.1:7070/")
    with pytest.raises(ValueError, match="without http://"):
        WorkerConfig(broker="http://h:1", http_url="http://h:2")
    with pytest.raises(Exception, match=re.escape("got a URL: write '127.0.0.1:8080'")):
        _host_port("http://127.0.0.1:8080")
    assert _host_port("0.0.0.0:8080") == ("0.0.0.0", 8080)


def test_worker_command_line_accepts_one_url_and_the_old_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from clients.worker.__main__ import build_parser, config_from_args

    def config(*argv: str) -> WorkerConfig:
        return config_from_args(build_parser().parse_args(list(argv)))

    for name in ("STEWARD_BROKER", "STEWARD_URL"):
        monkeypatch.delenv(name, raising=False)
    one = config("--broker", "http://b1:8080,http://b2:8080")
    assert one.brokers == ["http://b1:8080", "http://b2:8080"] and one.download_from_leader
    assert config("--brokers", "http://b1:8080").brokers == ["http://b1:8080"]
    direct = config("--broker", "h:7071")
    assert direct.brokers == [] and direct.broker_address() == ("h", 7071)
    # No flag: the local broker's HTTP URL, as the CLI's default.
    assert config().brokers == ["http://127.0.0.1:8080"]
    monkeypatch.setenv("STEWARD_URL", "http://u:1")
    assert config().brokers == ["http://u:1"]
    monkeypatch.setenv("STEWARD_BROKER", "e:7")
    assert config().broker_address() == ("e", 7)
    monkeypatch.setenv("STEWARD_BROKER", "nonsense")
    with pytest.raises(ValueError, match="STEWARD_BROKER: expected the broker's HTTP URL"):
        config()
    for bad in (["--broker", "http://x:1/,y:2"], ["--brokers", "b1:8080"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_the_first_bytes_tell_an_http_port_and_a_tls_port() -> None:
    http = sniff_answer(b"HTTP/1.1 400 Bad Request\r\n", "h:8080", tls=False)
    assert http is not None and "--broker http://h:8080" in str(http)
    assert "HTTP port, not its worker port" in str(http)
    tls = sniff_answer(b"\x15\x03\x03\x00\x02\x02\x32", "h:7070", tls=False)
    assert tls is not None and "add --tls" in str(tls)
    assert sniff_answer(b"\x00\x00\x00\x10\x83", "h:7070", tls=False) is None  # a frame
    assert sniff_answer(b"\x15\x03", "h:7070", tls=True) is None


def test_a_refused_token_cannot_heal_other_errors_may() -> None:
    wrong = refusal("h:7070", BrokerError("unauthorized", "wrong or missing worker token"))
    assert isinstance(wrong, LinkMisconfiguredError) and "--token-file" in str(wrong)
    assert isinstance(refusal("h:1", BrokerError("forbidden", "x")), LinkMisconfiguredError)
    busy = BrokerError("worker_id_in_use", "x")
    assert refusal("h:1", busy) is busy


class _Answers(ThreadingHTTPServer):
    """An HTTP server answering GET /api/v1/cluster with ``status`` and ``body``."""

    def __init__(self, status: int, body: bytes) -> None:
        answers = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(answers.status)
                self.send_header("content-length", str(len(answers.body)))
                self.end_headers()
                self.wfile.write(answers.body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.status, self.body = status, body
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def answers() -> Iterator[_Answers]:
    server = _Answers(200, b"{}")
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _summary(address: str | None, leader_url: str | None = None) -> bytes:
    return msgspec.json.encode(
        ClusterSummary(
            cluster_id="c",
            leader="b1" if address else None,
            brokers=[],
            workers=[],
            tasks={},
            tenants=0,
            leader_url=leader_url,
            leader_worker_address=address,
        )
    )


def _free_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens


async def test_find_leader_tells_misconfigurations_from_what_may_heal(answers: _Answers) -> None:
    for status, body, words in (
        (401, b"{}", "wants a token, none given"),
        (404, b"not found", "is not a Steward broker (HTTP 404"),
        (200, b"<html>", "is not a Steward broker"),
    ):
        answers.status, answers.body = status, body
        with pytest.raises(LinkMisconfiguredError, match=re.escape(words)):
            await find_leader([answers.url], timeout_s=2.0)
    answers.status = 401
    with pytest.raises(LinkMisconfiguredError, match="refused the worker's token"):
        await find_leader([answers.url], timeout_s=2.0, token="wrong")
    # A broker down or none elected yet: retrying may heal it.
    answers.status, answers.body = 200, _summary(None)
    with pytest.raises(LeaderUnknownError, match="no leader known yet"):
        await find_leader([answers.url], timeout_s=2.0)
    with pytest.raises(LeaderUnknownError, match="connection refused"):
        await find_leader([_free_url()], timeout_s=2.0)
    answers.status = 503
    with pytest.raises(LeaderUnknownError, match="HTTP 503"):
        await find_leader([answers.url], timeout_s=2.0)
    # One broker misconfigured and one down: it may still come up.
    answers.status = 404
    with pytest.raises(LeaderUnknownError):
        await find_leader([answers.url, _free_url()], timeout_s=2.0)


async def test_a_worker_port_given_as_an_http_url_is_named() -> None:
    async def worker_port(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"\x00\x00\x00\x05\x83\xa4type")  # a frame, not HTTP
        writer.close()

    server = await asyncio.start_server(worker_port, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(LinkMisconfiguredError, match=r"does not answer HTTP \(a worker port"):
            await find_leader([f"http://127.0.0.1:{port}"], timeout_s=2.0)
    finally:
        server.close()


async def test_a_wildcard_worker_address_is_reached_at_the_leaders_host(
    answers: _Answers,
) -> None:
    answers.body = _summary("0.0.0.0:7070", "http://10.1.2.3:8080")
    leader = await find_leader([answers.url], timeout_s=2.0)
    assert leader.worker_address == "10.1.2.3:7070"
    answers.body = _summary("0.0.0.0:7070")
    assert (await find_leader([answers.url], timeout_s=2.0)).worker_address == "127.0.0.1:7070"
    # A standalone broker on --http 0.0.0.0:8080: the host the worker asked.
    answers.body = _summary("0.0.0.0:7070", "http://0.0.0.0:8080")
    assert (await find_leader([answers.url], timeout_s=2.0)).worker_address == "127.0.0.1:7070"
    answers.body = _summary("b1.example:7070", "http://0.0.0.0:8080")
    assert (await find_leader([answers.url], timeout_s=2.0)).worker_address == "b1.example:7070"


def test_repeated_failures_are_logged_now_and_then_and_misconfigurations_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    config = WorkerConfig(
        broker="h:1", http_url="http://h:2", give_up_after_s=20.0, problem_log_interval_s=10.0
    )
    problems = Problems(config, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, "clients.worker.link")
    for _ in range(5):  # the same transient failure, at once: one line
        problems.failed("h:1", ConnectionRefusedError(111, "Connection refused"))
    assert len(caplog.records) == 1
    assert "waiting for the worker endpoint h:1: connection refused" in caplog.text
    now[0] = 11.0
    problems.failed("h:1", ConnectionRefusedError(111, "Connection refused"))
    assert len(caplog.records) == 2 and "6 attempts in 11 s" in caplog.text
    # A misconfiguration: logged at once, fatal after give_up_after_s of nothing else.
    wrong = LinkMisconfiguredError("h:1 answered in HTTP")
    problems.failed("h:1", wrong)
    assert "exiting if it persists for 20 s" in caplog.records[-1].getMessage()
    now[0] = 25.0
    problems.failed("h:1", ConnectionRefusedError(111, "Connection refused"))  # resets
    now[0] = 40.0
    problems.failed("h:1", wrong)
    with pytest.raises(LinkMisconfiguredError):
        now[0] = 60.0
        problems.failed("h:1", wrong)
    problems.connected()
    problems.failed("h:1", wrong)  # a new streak after a Welcome


async def test_a_worker_given_an_http_port_gives_up_with_the_one_line() -> None:
    async def http_port(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(http_port, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = WorkerConfig(
        broker=f"127.0.0.1:{port}",
        http_url="http://127.0.0.1:1",
        task_isolation="thread",
        spark="off",
        give_up_after_s=0.5,
        reconnect_backoff_max_s=0.2,
    )
    worker = Worker(config)
    try:
        with pytest.raises(LinkMisconfiguredError, match=f"--broker http://127.0.0.1:{port}"):
            await asyncio.wait_for(worker.run(), WAIT_S)
    finally:
        await worker.stop(wait=False, timeout_s=0.0)
        server.close()


def test_a_taken_port_names_the_flag_that_moves_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BrokerStartupError) as caught:
            check_port_free("127.0.0.1", port, WORKER_PORT)
        message = str(caught.value)
        assert f"cannot listen for workers on 127.0.0.1:{port}: address already in use" in message
        assert "--worker-listen HOST:PORT" in message and "\n" not in message
        with pytest.raises(BrokerStartupError, match=r"could not serve HTTP on .* --http HOST"):
            check_port_free("127.0.0.1", port, HTTP_PORT)
    check_port_free("127.0.0.1", 0, WORKER_PORT)  # a free port is picked: nothing to check
    check_port_free("127.0.0.1", port, HTTP_PORT)  # free again
