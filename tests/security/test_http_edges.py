"""The HTTP edge of a real ``steward standalone`` broker under attack (issue 14, item 7).

Oversized request headers get 431 with a JSON error before the broker holds them;
clients that send their headers or body slowly are cut off after the timeout (408);
connections beyond ``--http-max-connections`` get 503 at once. During each attack
the broker's resident memory grows by less than 64 MB and ``GET /healthz`` answers
within 1 s (tests/support/edge_probes.py).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.edge_probes import AttackWatch, connect, read_until_closed, send_ignoring_close
from tests.support.procs import BrokerProcess

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 32
MAX_HEAD_BYTES = 64 * 1024
# How much later than its timeout a slow client may still be connected (a loaded machine).
CUT_OFF_MARGIN_S = 3.0
ATTACK_HEADER_BYTES = 50 * 1024 * 1024  # the attack: 4 connections like this
THREAD_JOIN_S = 60.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("http-edges")
    process = BrokerProcess(
        root / "data",
        log_path=root / "broker.log",
        extra_args=(
            "--http-header-timeout-s",
            str(HEADER_TIMEOUT_S),
            "--http-body-timeout-s",
            str(BODY_TIMEOUT_S),
            "--http-max-connections",
            str(MAX_CONNECTIONS),
        ),
    )
    with process:
        process.start()
        yield process
        assert process.running(), process.log_tail()
        assert "Traceback" not in process.log_text(), process.log_tail(20_000)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """Status, headers and JSON body of one HTTP/1.1 response."""
    head, separator, body = raw.partition(b"\r\n\r\n")
    assert separator, f"no complete response: {raw[:300]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    return status, headers, json.loads(body[:length])


def run_threads(count: int, target: Any) -> list[Any]:
    """Run ``target(index)`` in ``count`` threads; their results (or exceptions), in order."""
    results: list[Any] = [None] * count

    def run(index: int) -> None:
        try:
            results[index] = target(index)
        except Exception as exc:  # reported by the caller
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_JOIN_S)
        assert not thread.is_alive(), "an attacking thread did not finish"
    return results


def test_oversized_headers_get_431_json_while_memory_stays_bounded(broker: BrokerProcess) -> None:
    big_header = b"X-Filler: " + b"a" * ATTACK_HEADER_BYTES + b"\r\n"

    def attack(_: int) -> tuple[int, int, dict[str, str], Any]:
        with connect(broker.port) as sock:
            sent = send_ignoring_close(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + big_header)
            status, headers, body = parse_response(read_until_closed(sock))
            return sent, status, headers, body

    with AttackWatch(broker.url, broker.pid) as watch:
        results = run_threads(4, attack)
    for result in results:
        assert not isinstance(result, Exception), repr(result)
        _, status, headers, body = result
        assert status == 431
        assert headers["content-type"] == "application/json"
        assert headers["connection"] == "close"
        assert body["error"]["code"] == "headers_too_large"
        assert str(MAX_HEAD_BYTES) in body["error"]["message"]
    watch.check()
    # Headers below the bound are served as before.
    response = httpx.get(f"{broker.url}/healthz", headers={"x-filler": "b" * 60_000}, timeout=10)
    assert response.status_code == 200, response.text
    assert "refused HTTP connection from 127.0.0.1:" in broker.log_text()


def test_many_header_lines_count_towards_the_bound(broker: BrokerProcess) -> None:
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(20_000))  # ~200 KiB of small headers
    with connect(broker.port) as sock:
        send_ignoring_close(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
        status, _, body = parse_response(read_until_closed(sock))
    assert status == 431
    assert body["error"]["code"] == "headers_too_large"


def dribble(sock: socket.socket, first: bytes, byte: bytes, give_up_s: float) -> float:
    """Send ``first``, then ``byte`` every 0.1 s until the broker closes the connection or
    ``give_up_s`` passes; returns the seconds the connection lived."""
    started = time.monotonic()
    sock.sendall(first)
    while time.monotonic() - started < give_up_s:
        try:
            sock.sendall(byte)
        except (BrokenPipeError, ConnectionResetError):
            break
        # A closed connection shows as readable (the 408, then EOF).
        sock.settimeout(0.1)
        try:
            peeked = sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if peeked:
            break
    return time.monotonic() - started


def slow_clients(broker: BrokerProcess, first: bytes, timeout_s: float) -> list[Any]:
    """MAX_CONNECTIONS / 2 clients send ``first``, then a byte every 0.1 s: each must get
    a 408 with a JSON error and be closed within its timeout plus a margin."""
    give_up_s = timeout_s + CUT_OFF_MARGIN_S

    def slow_client(_: int) -> tuple[float, bytes]:
        with connect(broker.port, timeout_s=give_up_s) as sock:
            lived_s = dribble(sock, first, b"a", give_up_s)
            sock.settimeout(give_up_s)
            return lived_s, read_until_closed(sock)

    results = run_threads(MAX_CONNECTIONS // 2, slow_client)
    for result in results:
        assert not isinstance(result, Exception), repr(result)
        lived_s, raw = result
        assert lived_s < give_up_s, f"a slow client was still connected after {lived_s:.1f} s"
        status, headers, body = parse_response(raw)
        assert status == 408
        assert headers["content-type"] == "application/json"
        assert body["error"]["code"] == "request_timeout"
    return results


def test_slow_header_clients_are_cut_off_with_408(broker: BrokerProcess) -> None:
    with AttackWatch(broker.url, broker.pid) as watch:
        slow_clients(broker, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ", HEADER_TIMEOUT_S)
    watch.check()


def test_slow_body_clients_are_cut_off_but_a_steady_upload_is_not(broker: BrokerProcess) -> None:
    first = (
        b"POST /api/v1/tasks HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n"
    )
    with AttackWatch(broker.url, broker.pid) as watch:
        slow_clients(broker, first, BODY_TIMEOUT_S)
    watch.check()
    # About 600 KiB in 16 KiB pieces every 0.05 s: about 2 s, longer than the body
    # timeout, at over 64 KiB/s (the minimum rate that moves the deadline on).
    batch = {"tasks": [{"type": "steady", "params": "p" * 30_000} for _ in range(20)]}
    body = json.dumps(batch).encode()

    def pieces() -> Iterator[bytes]:
        for offset in range(0, len(body), 16 * 1024):
            time.sleep(0.05)
            yield body[offset : offset + 16 * 1024]

    response = httpx.post(
        f"{broker.url}/api/v1/tasks",
        content=pieces(),
        headers={"content-type": "application/json", "content-length": str(len(body))},
        timeout=30,
    )
    assert response.status_code == 200, response.text


def test_connections_beyond_the_cap_get_503(broker: BrokerProcess) -> None:
    with AttackWatch(broker.url, broker.pid) as watch:
        # The watch holds one connection; fill the rest with kept-alive clients.
        holders = [httpx.Client(base_url=broker.url, timeout=10) for _ in range(MAX_CONNECTIONS)]
        try:
            served = [h.get("/healthz").status_code for h in holders[: MAX_CONNECTIONS - 1]]
            assert served == [200] * (MAX_CONNECTIONS - 1)

            def refused(_: int) -> tuple[int, dict[str, str], Any, int]:
                with connect(broker.port) as sock:
                    local_port = sock.getsockname()[1]
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                    status, headers, body = parse_response(read_until_closed(sock))
                    return status, headers, body, local_port

            # Well beyond the cap, and beyond the refused connections the broker lingers on.
            results = run_threads(MAX_CONNECTIONS * 4, refused)
            for result in results:
                assert not isinstance(result, Exception), repr(result)
                status, headers, body, _ = result
                assert status == 503
                assert headers["content-type"] == "application/json"
                assert body["error"]["code"] == "too_many_connections"
                assert body["error"]["retryable"] is True
            # A freed slot serves again.
            holders[0].close()
            deadline = time.monotonic() + 10
            while holders[-1].get("/healthz").status_code != 200:
                assert time.monotonic() < deadline, "no connection served after one was freed"
                time.sleep(0.1)
        finally:
            for holder in holders:
                holder.close()
    watch.check()
    # Refusals are logged with the peer's address (at most 20 lines a second).
    log = broker.log_text()
    assert any(f"connection from 127.0.0.1:{r[3]}: 503 " in log for r in results), log[-3000:]


def test_malformed_request_gets_a_json_400(broker: BrokerProcess) -> None:
    with connect(broker.port) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = parse_response(read_until_closed(sock))
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert body["error"]["code"] == "invalid_request"


def test_a_request_answered_early_gets_no_second_answer_when_its_body_stalls(
    broker: BrokerProcess,
) -> None:
    # Declared over the 8 MiB body cap: 413 at once; the body that follows is dropped
    # and, arriving too slowly, ends the connection without another answer.
    first = (
        b"POST /api/v1/tasks HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 9000000\r\n\r\n"
    )
    give_up_s = BODY_TIMEOUT_S + CUT_OFF_MARGIN_S
    with connect(broker.port, timeout_s=give_up_s) as sock:
        sock.sendall(first)
        status, _, body = parse_response(sock.recv(65536))
        assert status == 413
        assert body["error"]["code"] == "too_large"
        lived_s = dribble(sock, b"", b"a", give_up_s)
        sock.settimeout(give_up_s)
        rest = read_until_closed(sock)
    assert lived_s < give_up_s, f"the stalled body kept the connection for {lived_s:.1f} s"
    assert rest == b""
