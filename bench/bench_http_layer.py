"""CPU per request through the broker's HTTP layer, in process: the broker's protocol
(broker/api/edges.py) fed whole requests by a fake transport, the ApiApp on an
in-memory node. No sockets, so no system calls and no other process: the figure is
the Python cost of parsing, dispatch, the handler and the response, and it holds on a
loaded machine (CPU time, best of 3) where wall-clock rates do not.

    python bench/bench_http_layer.py                    # submit, get, healthz
    python bench/bench_http_layer.py healthz --count 20000
    python bench/bench_http_layer.py --uvicorn-defaults # proxy_headers and server header on
                                                        # (as the server was before issue 16)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
from uvicorn.server import ServerState

from broker.api.edges import bounded_http_protocol
from broker.api.http_api import ApiApp, ApiConfig
from broker.observability.node_observer import observe_node
from broker.replication.node import Node, NodeConfig
from log.memory import MemoryLedgerListStore, MemoryLedgerStore
from snapshot.store import SnapshotStore

_BODY = json.dumps({"type": "noop", "tenant": "t"}).encode()
REQUESTS = {
    "healthz": b"GET /healthz HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n",
    "get": b"GET /api/v1/tasks/1 HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n",
    "submit": b"POST /api/v1/tasks HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n"
    b"Content-Type: application/json\r\nIdempotency-Key: %s\r\n"
    b"Content-Length: %d\r\n\r\n%s",
}


class FakeTransport:
    """Takes the protocol's writes; each response's write completes ``done``."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] | None = None
        self.closing = False

    def write(self, data: bytes) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        extra = {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 80)}
        return extra.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def run(kinds: list[str], count: int, uvicorn_defaults: bool) -> None:
    data_dir = Path(tempfile.mkdtemp())
    node = Node(
        NodeConfig(data_dir=data_dir, timer_poll_interval_s=0.05),
        ledgers=MemoryLedgerStore(),
        ledger_list=MemoryLedgerListStore(),
        snapshots=SnapshotStore(data_dir / "snapshots"),
    )
    observe_node(node)
    await node.start()
    api = ApiConfig()
    config = uvicorn.Config(
        ApiApp(node, api),
        log_config=None,
        access_log=False,
        lifespan="off",
        proxy_headers=uvicorn_defaults,
        server_header=uvicorn_defaults,
        ws="none",
        http=bounded_http_protocol(api.edges),
    )
    config.load()
    protocol = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
    )
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    transport.done = loop.create_future()  # task 1, which "get" reads
    protocol.data_received(REQUESTS["submit"] % (b"first", len(_BODY), _BODY))
    await transport.done
    figures = []
    for kind in kinds:
        best = float("inf")
        for _ in range(3):
            started = time.process_time()
            for _ in range(count):
                raw = REQUESTS[kind]
                if kind == "submit":
                    raw = raw % (os.urandom(8).hex().encode(), len(_BODY), _BODY)
                transport.done = loop.create_future()
                protocol.data_received(raw)
                await transport.done
            best = min(best, (time.process_time() - started) / count)
        figures.append(f"{kind} {best * 1e6:.1f} us")
    print("CPU per request: " + " | ".join(figures))
    await node.stop(snapshot=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", help=f"of {sorted(REQUESTS)} (default: all)")
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--uvicorn-defaults", action="store_true")
    args = parser.parse_args()
    kinds = args.kinds or ["submit", "get", "healthz"]
    unknown = set(kinds) - set(REQUESTS)
    if unknown:
        parser.error(f"unknown request kinds {sorted(unknown)}")
    uvloop.run(run(kinds, args.count, args.uvicorn_defaults))


if __name__ == "__main__":
    main()
