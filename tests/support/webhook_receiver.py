"""A real HTTP webhook receiver for the webhook tests (docs/API.md, Webhooks): it checks
each POST's HMAC-SHA256 signature, refuses (503) its first ``failures_left`` deliveries
and any while ``refusing``, and records the others with their event ids. Binds to
127.0.0.1; stopped by the context manager on every exit path."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.procs import HOST


@dataclass
class Receiver:
    secret: str
    failures_left: int = 0
    refusing: bool = False  # refuse everything while set (after the first failures)
    delivered: list[tuple[str, dict[str, object]]] = field(default_factory=list)
    refused_at: list[float] = field(default_factory=list)
    bad_signatures: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def delivered_ids(self) -> list[int]:
        with self.lock:
            return [int(str(task["id"])) for _, task in self.delivered]

    def status_for(self, body: bytes, signature: str) -> int:
        expected = "sha256=" + hmac.new(self.secret.encode(), body, hashlib.sha256).hexdigest()
        with self.lock:
            if not hmac.compare_digest(expected, signature):
                self.bad_signatures += 1
                return 400
            if self.failures_left > 0 or self.refusing:
                self.failures_left = max(0, self.failures_left - 1)
                self.refused_at.append(time.monotonic())
                return 503
            return 200


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            status = receiver.status_for(body, self.headers["x-steward-signature"] or "")
            if status == 200:
                with receiver.lock:
                    event_id = self.headers["x-steward-event-id"]
                    receiver.delivered.append((event_id, json.loads(body)))
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def webhook_receiver(receiver: Receiver) -> Iterator[str]:
    """Serve ``receiver``; yields its URL."""
    server = ThreadingHTTPServer((HOST, 0), _handler(receiver))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
