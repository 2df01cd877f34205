"""The commands that run a broker or a local cluster in this process: ``steward
standalone``, ``steward broker`` and ``steward cluster up``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from clients.cli.options import UsageError, _tls_config


def _code_retention_ms(args: argparse.Namespace) -> int:
    hours = args.code_retention_h
    if not 0 <= hours <= 100 * 365 * 24:
        raise UsageError("--code-retention-h must be >= 0 hours (0: keep forever)")
    return int(hours * 3600 * 1000)


if TYPE_CHECKING:
    from broker.api.edges import HttpEdgeConfig
    from broker.api.http_api import ApiConfig
    from broker.security.auth import AuthConfig
    from broker.workers.worker_link import WorkerLinkConfig
    from log.pulsar import PulsarConfig


def _http_edges(args: argparse.Namespace) -> HttpEdgeConfig:
    from broker.api.edges import HttpEdgeConfig

    edges = HttpEdgeConfig(
        header_timeout_s=args.http_header_timeout_s,
        body_timeout_s=args.http_body_timeout_s,
        max_connections=args.http_max_connections,
    )
    problem = edges.problem()
    if problem is not None:
        raise UsageError(f"--http-*: {problem}")
    if not args.worker_hello_timeout_s > 0 or args.worker_max_unauthenticated < 1:
        raise UsageError("need --worker-hello-timeout-s > 0 and --worker-max-unauthenticated >= 1")
    if not args.max_task_output_mb >= 0:
        raise UsageError("--max-task-output-mb must be >= 0")
    return edges


def _auth_config(args: argparse.Namespace) -> AuthConfig:
    """Authentication settings of a broker from its options (off without an admin token).

    Sets ``args.worker_token`` and ``args.cluster_token`` to the secrets found (file,
    deprecated command line, environment) and removes the secrets' environment variables,
    so the broker's children (workers it starts get theirs explicitly) inherit none."""
    from broker.security.auth import AuthConfig, SecretOptionError, read_secret, secret_from_options

    def warn(message: str) -> None:
        print(f"steward: warning: {message}", file=sys.stderr, flush=True)

    try:
        for name in ("worker_token", "cluster_token"):  # --worker-token, --cluster-token
            flag = "--" + name.replace("_", "-")
            secret = secret_from_options(
                argv_value=getattr(args, name),
                argv_flag=flag,
                file=getattr(args, f"{name}_file"),
                file_flag=f"{flag}-file",
                env=f"STEWARD_{name.upper()}",
                warn=warn,
            )
            setattr(args, name, secret)
    except SecretOptionError as exc:
        raise UsageError(str(exc)) from None
    admin_tokens: list[str] = []
    admin_from_env = os.environ.pop("STEWARD_ADMIN_TOKEN", None)
    if args.admin_token_file is not None:
        try:
            admin_tokens.append(read_secret(args.admin_token_file))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--admin-token-file: {exc}") from None
    elif admin_from_env:
        admin_tokens.append(admin_from_env)
    return AuthConfig.from_secrets(admin_tokens, args.worker_token, args.cluster_token)


def _api_config(args: argparse.Namespace, auth: AuthConfig) -> ApiConfig:
    """The HTTP API settings of a broker (standalone or of a cluster) from its options."""
    from broker.api.http_api import ApiConfig

    host, port = args.http
    return ApiConfig(host=host, port=port, auth=auth, edges=_http_edges(args))


def _worker_link_config(args: argparse.Namespace, auth: AuthConfig) -> WorkerLinkConfig:
    """The worker endpoint's settings of a broker (standalone or of a cluster)."""
    from broker.workers.worker_link import WorkerLinkConfig

    return WorkerLinkConfig(
        host=args.worker_listen[0],
        port=args.worker_listen[1],
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        hello_timeout_s=args.worker_hello_timeout_s,
        max_unauthenticated=args.worker_max_unauthenticated,
        token=args.worker_token,
        tenant_isolation=auth.enabled,
        worker_credentials=auth.enabled,
        max_output_total_bytes=int(args.max_task_output_mb * 1024 * 1024),
    )


def run_standalone(args: argparse.Namespace) -> int:

    import uvloop

    from broker.observability.logs import LOG_FORMAT_ENV, setup_logging
    from broker.replication.node import BrokerStartupError, NodeConfig
    from broker.server.standalone import StandaloneConfig, serve_standalone

    setup_logging(args.log_level, args.log_format)
    # Worker processes started beside the broker (--workers) log the same way.
    os.environ[LOG_FORMAT_ENV] = args.log_format
    auth = _auth_config(args)
    if auth.enabled and args.worker_token is None and args.workers > 0:
        # Other workers may use worker credentials; the ones started here share a token.
        raise UsageError(
            "with authentication on, the --workers started here need a shared token: "
            "give --worker-token-file PATH (or STEWARD_WORKER_TOKEN)"
        )
    config = StandaloneConfig(
        node=NodeConfig(
            data_dir=args.data_dir,
            snapshot_interval_s=args.snapshot_interval_s,
            ledger_roll_bytes=int(args.ledger_roll_mb * 1024 * 1024),
        ),
        api=_api_config(args, auth),
        workers=_worker_link_config(args, auth),
        child_workers=args.workers,
        tls=_tls_config(args),
        stop_grace_s=args.stop_grace_s,
        code_retention_ms=_code_retention_ms(args),
    )
    if args.workers < 0:
        raise UsageError("--workers must be >= 0")
    if not 0 <= args.stop_grace_s <= 86400:
        raise UsageError("--stop-grace-s must be between 0 and 86400 seconds")
    if not 0 < args.heartbeat_interval_ms < args.heartbeat_timeout_ms:
        raise UsageError("need 0 < --heartbeat-interval-ms < --heartbeat-timeout-ms")
    try:
        uvloop.run(serve_standalone(config))
    except BrokerStartupError as exc:
        print(f"steward: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


def _pulsar_config(args: argparse.Namespace) -> PulsarConfig | None:
    from log.pulsar import PulsarConfig

    if args.ledgers != "pulsar":
        return None
    tls_files = {
        "tls_trust_certs_file": ("--pulsar-tls-ca-file", args.pulsar_tls_ca_file),
        "tls_certificate_file": ("--pulsar-tls-cert-file", args.pulsar_tls_cert_file),
        "tls_private_key_file": ("--pulsar-tls-key-file", args.pulsar_tls_key_file),
    }
    for flag, path in tls_files.values():
        if path is not None and not path.is_file():
            raise UsageError(f"{flag} {path}: no such file")
    if (args.pulsar_tls_cert_file is None) != (args.pulsar_tls_key_file is None):
        raise UsageError("give --pulsar-tls-cert-file and --pulsar-tls-key-file together")
    settings: dict[str, Any] = {
        "admin_url": args.pulsar_admin_url,
        "tenant": args.pulsar_tenant,
        "namespace": args.pulsar_namespace,
        "cluster": args.cluster,
        "auth_token": args.pulsar_token,
    }
    for name, (_, path) in tls_files.items():
        settings[name] = str(path) if path is not None else None
    try:
        if args.pulsar_flavor == "pulsar-lite":
            return PulsarConfig.for_pulsar_lite(args.pulsar_url, **settings)
        return PulsarConfig.for_apache_pulsar(args.pulsar_url, **settings)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_broker(args: argparse.Namespace) -> int:
    import uvloop

    from broker.observability.logs import setup_logging
    from broker.replication.node import BrokerStartupError, NodeConfig
    from broker.server.cluster import BrokerConfig, serve_broker

    setup_logging(args.log_level, args.log_format, static_fields={"broker": args.broker_id})
    if not args.zookeeper:
        raise UsageError("--zookeeper is required (or env STEWARD_ZOOKEEPER)")
    if not 1 <= args.session_timeout_ms <= 600_000:
        raise UsageError("--session-timeout-ms must be in [1, 600000]")
    if args.min_replication < 1:
        raise UsageError("--min-replication must be >= 1")
    if args.max_replication_wait_ms < -1:
        raise UsageError("--max-replication-wait-ms must be >= 0, or -1 to wait forever")
    if not args.snapshot_source_wait_s > 0:
        raise UsageError("--snapshot-source-wait-s must be positive")
    if args.ledgers == "file" and args.ledger_dir is None:
        raise UsageError("--ledgers file needs --ledger-dir")
    if args.ledgers == "pulsar" and not args.pulsar_url:
        raise UsageError("--ledgers pulsar needs --pulsar-url")
    if not 0 < args.heartbeat_interval_ms < args.heartbeat_timeout_ms:
        raise UsageError("need 0 < --heartbeat-interval-ms < --heartbeat-timeout-ms")
    auth = _auth_config(args)
    if auth.enabled and args.cluster_token is None:
        # Workers need no shared token: they may use worker credentials (token create --worker).
        raise UsageError(
            "with authentication on, give --cluster-token-file PATH (or STEWARD_CLUSTER_TOKEN) too"
        )
    if args.zookeeper_auth is not None and ":" not in args.zookeeper_auth:
        raise UsageError("--zookeeper-auth must be USER:PASSWORD")
    config = BrokerConfig(
        node=NodeConfig(
            data_dir=args.data_dir,
            broker_id=args.broker_id,
            cluster_id=args.cluster,
            snapshot_interval_s=args.snapshot_interval_s,
            ledger_roll_bytes=int(args.ledger_roll_mb * 1024 * 1024),
            ledger_roll_age_ms=int(args.ledger_roll_age_s * 1000),
            ledger_retention_ms=int(args.ledger_retention_h * 3600 * 1000),
        ),
        zookeeper=args.zookeeper,
        ledger_dir=args.ledger_dir,
        ledgers=args.ledgers,
        pulsar=_pulsar_config(args),
        advertise_host=args.advertise,
        api=_api_config(args, auth),
        workers=_worker_link_config(args, auth),
        cluster_token=args.cluster_token,
        zookeeper_auth=args.zookeeper_auth,
        session_timeout_ms=args.session_timeout_ms,
        # The flag keeps its user-facing name, --min-replication.
        min_code_replicas=args.min_replication,
        max_replication_wait_ms=args.max_replication_wait_ms,
        snapshot_source_wait_s=args.snapshot_source_wait_s,
        tls=_tls_config(args),
        code_retention_ms=_code_retention_ms(args),
    )
    exit_code = 0
    try:
        uvloop.run(serve_broker(config))
    except BrokerStartupError as exc:
        print(f"steward: cannot start: {exc}", file=sys.stderr)
        exit_code = 2
    # Everything is closed and flushed (ledger, snapshot, ZooKeeper sessions), also after a
    # refused start. Leave without the interpreter's teardown: pulsar-client's C++ threads
    # can abort the process in static destructors at exit ("terminate called without an
    # active exception", exit -6 instead of 2: seen after the fencing check's refusal).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def run_cluster_up(args: argparse.Namespace) -> int:
    from clients.dev.local_cluster import LocalClusterConfig, run_local_cluster
    from clients.dev.zk import ZooKeeperError

    if args.brokers_deprecated is not None:
        # One meaning per flag name: --brokers is a list of broker URLs elsewhere (worker).
        print(
            "steward: warning: `cluster up --brokers N` is deprecated: use --broker-count N",
            file=sys.stderr,
            flush=True,
        )
        args.broker_count = args.brokers_deprecated
    if args.broker_count < 1 or args.workers < 0:
        raise UsageError("need --broker-count >= 1 and --workers >= 0")
    if not 1000 <= args.session_timeout_ms <= 60_000:
        raise UsageError("--session-timeout-ms must be in [1000, 60000]")
    if args.pulsar_flavor != "pulsar" and args.ledgers != "pulsar":
        raise UsageError(f"--pulsar-flavor {args.pulsar_flavor} needs --ledgers pulsar")
    config = LocalClusterConfig(
        data_dir=args.data_dir,
        brokers=args.broker_count,
        workers=args.workers,
        session_timeout_ms=args.session_timeout_ms,
        first_http_port=args.first_http_port,
        log_format=args.log_format,
        # The flag keeps its user-facing name, --min-replication.
        min_code_replicas=args.min_replication,
        ledgers=args.ledgers,
        pulsar_flavor=args.pulsar_flavor,
        tls=_tls_config(args),
        admin_token_file=args.admin_token_file,
    )
    try:
        return run_local_cluster(config)
    except (RuntimeError, ZooKeeperError, OSError, ValueError) as exc:
        print(f"steward: cluster up failed: {exc}", file=sys.stderr)
        return 2
