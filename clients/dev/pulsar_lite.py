"""A real pulsar-lite broker as a subprocess, for tests and the local dev cluster.

pulsar-lite (PyPI, ``pulsar-lite==0.2.0``) speaks Pulsar's binary protocol and keeps topics in
RocksDB; it is what ``steward cluster up --ledgers pulsar`` and the tests run the ``pulsar``
ledger backend against. It is started the way found to work on these machines: the binary shipped
inside the wheel (``pulsar_lite/bin/pulsar-lite``), a config file whose ``[metrics]`` section
is disabled (otherwise it serves metrics on 0.0.0.0:8080) and points at 127.0.0.1 anyway, and
``--addr 127.0.0.1:PORT --db-path DIR --log-level warn``. It is ready when it accepts TCP
connections on its port (it starts in about 0.05 s).

``--db-path P`` is a prefix: the broker keeps ``P.rocksdb/`` and ``P.metadata.json``. RocksDB's
lock file keeps a second broker off the same data while the first one runs.

Every wait is bounded and signals go to the broker's pid only.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from pathlib import Path

from clients.dev.local_server import HOST, LocalServerProcess

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 10.0
DEFAULT_STOP_TIMEOUT_S = 10.0
DEFAULT_LOG_LEVEL = "warn"
#: Environment variable naming the binary (overrides the one inside the pulsar-lite wheel).
BINARY_ENV = "STEWARD_PULSAR_LITE_BINARY"
_BINARY_RELATIVE_PATH = os.path.join("bin", "pulsar-lite")
_LOG_TAIL_BYTES = 4000
# Names the data below the directory (pulsar-lite appends ``.rocksdb`` and ``.metadata.json``).
_DB_PREFIX = "pulsar-lite"
_CONFIG_TEMPLATE = """\
# Written by steward (clients/dev/pulsar_lite.py) at every start; edits are lost.
log_level = "{log_level}"

[metrics]
# Enabled, pulsar-lite serves /metrics on 0.0.0.0:8080: every interface, and a port other
# instances on the host collide on. The address is loopback in case someone enables it.
enabled = false
addr = "127.0.0.1:0"
"""


class PulsarLiteError(RuntimeError):
    """pulsar-lite could not be found, started or stopped (details in the message)."""


def find_pulsar_lite_binary() -> str:
    """The pulsar-lite executable: ``$STEWARD_PULSAR_LITE_BINARY``, else the wheel's own.

    Raises :class:`PulsarLiteError` naming what was searched.
    """
    override = os.environ.get(BINARY_ENV)
    if override:
        if not os.access(override, os.X_OK):
            raise PulsarLiteError(f"${BINARY_ENV}={override} is not an executable file")
        return override
    # find_spec instead of import: the package's __init__ imports the pulsar client.
    spec = importlib.util.find_spec("pulsar_lite")
    if spec is None or spec.origin is None:
        raise PulsarLiteError(
            "pulsar-lite is not installed (pip install 'pulsar-lite==0.2.0', a dependency "
            f"of steward), or set {BINARY_ENV}"
        )
    binary = os.path.join(os.path.dirname(spec.origin), _BINARY_RELATIVE_PATH)
    if not os.path.isfile(binary):
        raise PulsarLiteError(f"the pulsar-lite wheel has no binary at {binary}")
    if not os.access(binary, os.X_OK):
        raise PulsarLiteError(f"{binary} is not executable (chmod +x it)")
    return binary


def accepts_connections(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on ``host:port`` right now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class PulsarLiteServer(LocalServerProcess):
    """One pulsar-lite broker process on 127.0.0.1.

    Everything lives in ``directory``: ``pulsar-lite.toml`` (written at each start),
    ``data/`` (the topics, kept across :meth:`restart` and :meth:`kill` + :meth:`start`) and
    ``pulsar-lite.log`` (the broker's output, appended to by every start). The port is chosen
    once (a free one unless given) and kept across restarts, so clients reconnect to the
    same address.

    ``stop_with_parent=True`` (Linux, for tests) makes the kernel send the broker SIGTERM when
    the thread that started it ends, so a killed test run leaves no broker behind.
    """

    server_name = "pulsar-lite"
    error_type = PulsarLiteError
    port_taken_markers = ("AddrInUse", "Address already in use")
    ready_poll_s = 0.02
    start_timeout_s = DEFAULT_START_TIMEOUT_S

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        port: int | None = None,
        log_level: str = DEFAULT_LOG_LEVEL,
        binary: str | None = None,
        stop_with_parent: bool = False,
    ) -> None:
        super().__init__(directory, port=port, stop_with_parent=stop_with_parent)
        self._log_level = log_level
        # Resolved now so a missing binary fails at construction, loudly.
        self._binary = binary if binary is not None else find_pulsar_lite_binary()

    # -- properties --------------------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        return self._directory / "pulsar-lite.toml"

    @property
    def log_path(self) -> Path:
        return self._directory / "pulsar-lite.log"

    @property
    def service_url(self) -> str:
        """``pulsar://127.0.0.1:PORT``, for ``pulsar.Client`` and ``PulsarConfig``."""
        return f"pulsar://{HOST}:{self._port}"

    @property
    def address(self) -> str:
        return self.service_url

    def _ready(self) -> bool:
        return accepts_connections(HOST, self._port, timeout_s=0.5)

    def kill(self) -> None:
        """SIGKILL (a crash: no clean shutdown). No-op when not running."""
        self._kill_process()

    # -- files and command -------------------------------------------------------------------

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(_CONFIG_TEMPLATE.format(log_level=self._log_level))

    def _command(self) -> list[str]:
        return [
            self._binary,
            "--config",
            str(self.config_path),
            "--addr",
            f"{HOST}:{self._port}",
            "--db-path",
            str(self.data_dir / _DB_PREFIX),
            "--log-level",
            self._log_level,
        ]

    # -- context manager ---------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"PulsarLiteServer({self.service_url}, pid={self.pid}, dir={self._directory})"
