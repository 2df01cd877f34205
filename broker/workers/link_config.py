"""The worker link's configuration: read by the link and each of its collaborators
(handshake, liveness, finish queue, finish reports), so it lives beside them, not in
:mod:`~broker.workers.worker_link` (which imports them)."""

from __future__ import annotations

from dataclasses import dataclass

from broker.security.tls import TlsConfig
from wire import worker_protocol as p


@dataclass(frozen=True)
class WorkerLinkConfig:
    host: str = "127.0.0.1"
    port: int = 7070
    heartbeat_interval_ms: int = 1000
    # A worker silent (or disconnected) this long is declared dead (longer at scale: below).
    heartbeat_timeout_ms: int = 10_000
    # Heartbeats per second the leader takes across all its workers: with more workers
    # than this times the interval, a Welcome names a longer interval, and a timeout of at
    # least three of them, so idle cost stays flat (docs/DESIGN.md §8). 0: off.
    heartbeats_per_s: int = 1000
    # A connection must send its hello within this (it is closed with an error frame after).
    hello_timeout_s: float = 5.0
    # Before the hello is accepted nothing longer is read: a hello carries 7 to 15 bytes
    # per task the worker still runs, so this fits a worker running over 17,000 tasks.
    max_hello_bytes: int = 256 * 1024
    # Connections still in their handshake (TLS done, hello not yet accepted); more are
    # refused with an error frame. Their buffers are bounded by max_hello_bytes each.
    max_unauthenticated: int = 64
    # Workers connect over TLS (the broker's certificate) when set.
    tls: TlsConfig | None = None
    max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES
    max_result_bytes: int = 1024 * 1024
    max_assignments_per_round: int = 2000
    max_reports_per_entry: int = 5000
    # Children one finish report may spawn (each admitted as a submit's task is:
    # broker/core/admission.py, params within its MAX_PARAMS_BYTES).
    max_spawns_per_report: int = 10_000
    # The shared worker token (legacy, unscoped): any worker holding it may connect.
    token: str | None = None
    # Authentication on: a task may spawn children only in its own tenant, using code
    # its tenant may use (a task must not act for another tenant).
    tenant_isolation: bool = False
    # Authentication on: worker credentials issued through the API (role "worker") are
    # accepted, and some credential is required even without a shared token.
    worker_credentials: bool = False
    # Task output kept on the leader (broker/api/output_store.py): in total, the least
    # recently written attempt evicted first (each attempt keeps its last 1 MiB).
    max_output_total_bytes: int = 256 * 1024 * 1024
