"""Two tenants running an uploaded job module on real processes: a ``steward standalone``
with authentication on, one ``steward worker`` (task processes under uids of their own),
a token and an HTTP client per tenant, and the job's code uploaded. Shared by the end-to-end
tests of task output, progress and trees; everything is stopped on every exit path, and a
failure prints the worker's and the broker's log tails."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.procs import HOST, BrokerProcess, authenticated_broker
from tests.support.worker_procs import WorkerProcess, task_writable_dir

TENANTS = ("alice", "bob")


@dataclass
class TenantJobs:
    broker: BrokerProcess
    worker: WorkerProcess
    admin: httpx.Client
    tenants: dict[str, httpx.Client]  # by tenant name, with that tenant's token
    tokens: dict[str, str]
    sha: str  # the job module's sha256
    shared: Path  # a directory the task processes can write (to signal the test)


@contextlib.contextmanager
def tenant_jobs(
    tmp_path: Path,
    *,
    admin_token: str,
    worker_token: str,
    worker_id: str,
    job: bytes,
    slots: int,
    uploaders: Sequence[str] = ("alice",),
) -> Iterator[TenantJobs]:
    """The broker, a worker taking ``slots`` tasks of any type, and ``job`` uploaded as
    ``job.py`` by each of ``uploaders`` (a tenant runs only the code it uploaded)."""
    with (
        authenticated_broker(tmp_path, admin_token=admin_token, worker_token=worker_token) as auth,
        task_writable_dir() as shared,
    ):
        worker = WorkerProcess(
            broker=f"{HOST}:{auth.worker_port}",
            http_url=auth.broker.url,
            worker_id=worker_id,
            log_dir=tmp_path / "logs",
            cache_dir=tmp_path / "cache",
            extra_args=("--token-file", str(auth.worker_token_file), "--task-type", f"*={slots}"),
        ).start()
        clients: dict[str, httpx.Client] = {}
        try:
            worker.wait_connected(auth.http)
            tokens = {}
            for tenant in TENANTS:
                created = auth.http.post(
                    "/api/v1/tokens", json={"name": f"{tenant}-key", "tenant": tenant}
                )
                assert created.status_code == 201, created.text
                tokens[tenant] = created.json()["token"]
                clients[tenant] = httpx.Client(
                    base_url=auth.broker.url,
                    headers={"authorization": f"Bearer {tokens[tenant]}"},
                    timeout=90,
                )
            shas = set()
            for tenant in uploaders:
                uploaded = clients[tenant].post(
                    "/api/v1/code", params={"name": "job.py"}, content=job
                )
                assert uploaded.status_code == 201, uploaded.text
                shas.add(uploaded.json()["sha256"])
            (sha,) = shas  # the same bytes: the same name
            yield TenantJobs(auth.broker, worker, auth.http, clients, tokens, sha, shared)
        except BaseException:
            print(worker.log_tail())
            print(auth.broker.log_tail())
            raise
        finally:
            for client in clients.values():
                client.close()
            worker.stop()
