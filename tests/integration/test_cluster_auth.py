"""Authentication in a cluster of real broker processes (issue 7).

Three ``steward broker`` processes with an admin token file, a worker token, a cluster
token and ZooKeeper digest credentials, a real worker, and the real CLI:

- tokens made through the CLI on one broker work on every broker (replicated state),
  and a revocation reaches the followers;
- a tenant sees and runs only its own tasks and code; no credentials: 401;
- brokers fetch each other's code artifacts with the cluster token (``--min-replication
  3`` makes an upload wait for those fetches);
- a worker with the wrong token is refused, the right one runs tasks;
- Steward's znodes are closed to ZooKeeper clients without the credentials;
- after ``kill -9`` of the leader the new leader (elected through authenticated
  ZooKeeper sessions) serves the same tokens.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import NoAuthError  # type: ignore[import-untyped]

from clients.client import AuthenticationError, NotFoundError, StewardClient
from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses
from tests.support.procs import steward_command
from tests.support.worker_procs import wait_until

ADMIN = "admin-secret-for-the-test"
WORKER = "worker-secret-for-the-test"
CLUSTER_TOKEN = "cluster-secret-for-the-test"
ZK_AUTH = "steward:zk-secret-for-the-test"
JOB = b"def run(params, ctx):\n    return {'doubled': params['n'] * 2}\n"


def cli(urls: list[str], token: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    command = [*steward_command(), "--url", ",".join(urls)]
    if token is not None:
        command += ["--token", token]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=60, check=False
    )


def create_token(urls: list[str], name: str, tenant: str) -> tuple[str, str]:
    """(token id, secret) made with ``steward token create``."""
    done = cli(urls, ADMIN, "token", "create", name, "--tenant", tenant)
    assert done.returncode == 0, done.stderr
    first, secret = done.stdout.strip().splitlines()[-2:]
    assert first.startswith("token ") and secret.startswith("stw_"), done.stdout
    return first.split()[1], secret


def test_tokens_tenants_workers_peers_and_zookeeper_acls_in_a_cluster(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN + "\n")
    worker_file = tmp_path / "worker-token"
    worker_file.write_text(WORKER + "\n")
    # Secrets in files and the environment, never on a command line.
    auth_args = (
        "--admin-token-file",
        str(admin_file),
        "--worker-token-file",
        str(worker_file),
        "--zookeeper-auth",
        ZK_AUTH,
        "--min-replication",
        "3",
    )
    with ClusterProcesses(
        zookeeper.connect_string,
        tmp_path,
        extra_args=auth_args,
        admin_token=ADMIN,
        extra_env={"STEWARD_CLUSTER_TOKEN": CLUSTER_TOKEN},
    ) as cluster:
        try:
            leader = cluster.wait_for_leader()
            cluster.wait_for_equal_digests()
            urls = cluster.urls()
            followers = [n for n in cluster.live() if n.broker_id != leader.broker_id]

            # No credentials: nothing but health and the schema.
            for node in (leader, followers[0]):
                assert httpx.get(node.url + "/api/v1/tasks", timeout=5).status_code == 401
                assert httpx.get(node.url + "/healthz", timeout=5).status_code == 200
            refused = cli(urls, None, "tasks")
            assert refused.returncode == 1 and "Traceback" not in refused.stderr
            assert refused.stderr.startswith("steward: ") and "token" in refused.stderr

            alice_id, alice = create_token(urls, "alice-ci", "alice")
            _, bob = create_token(urls, "bob-ci", "bob")
            listed = cli(urls, ADMIN, "token", "list")
            assert listed.returncode == 0 and "alice-ci" in listed.stdout
            assert alice not in listed.stdout  # secrets are shown once, at creation

            # A tenant token made on the leader works on a follower (replicated state).
            on_follower = StewardClient([followers[0].url], token=alice, timeout_s=10)
            wait_until(lambda: _whoami(on_follower), 10, "alice's token on a follower")

            # Alice's code: the other brokers fetch it with the cluster token (ready at 3).
            with StewardClient(urls, token=alice, timeout_s=10) as as_alice:
                job = tmp_path / "job.py"
                job.write_bytes(JOB)
                sha256 = as_alice.upload_code(job)
                wait_until(
                    lambda: (
                        all((n.data_dir / "code" / sha256).exists() for n in cluster.live())
                        and _ready(leader.url, sha256)
                    ),
                    30,
                    "the artifact to reach 3 brokers",
                )
                # A worker with the wrong token is refused; the right one runs the task.
                intruder = cluster.start_worker(
                    "intruder", env={"STEWARD_WORKER_TOKEN": "wrong-token"}
                )
                cluster.start_worker("w1", env={"STEWARD_WORKER_TOKEN": WORKER})
                # A worker credential made with the CLI, scoped to Alice, in a file.
                made = cli(urls, ADMIN, "token", "create", "w2", "--worker", "--tenants", "alice")
                assert made.returncode == 0 and "serving alice" in made.stdout, made.stderr
                scoped_file = tmp_path / "w2-token"
                scoped_file.write_text(made.stdout.strip().splitlines()[-1] + "\n")
                cluster.start_worker("w2", "--token-file", str(scoped_file))
                cluster.wait_workers_connected(["w1", "w2"])
                workers = leader.get_json("/api/v1/workers", timeout_s=5)["workers"]
                assert {w["id"]: w["tenants"] for w in workers}["w2"] == ["alice"]
                handle = as_alice.submit("job:run", {"n": 21}, code=sha256)
                assert handle.result(timeout=60) == {"doubled": 42}
                task_id = handle.id
                assert "intruder" not in cluster.connected_workers(leader)
                assert intruder.running() or "refused the worker's token" in intruder.log_tail()

            # Bob sees none of it, on the leader or a follower.
            for url in (leader.url, followers[0].url):
                with StewardClient([url], token=bob, timeout_s=10) as as_bob:
                    with pytest.raises(NotFoundError):
                        as_bob.task(task_id)
                    assert as_bob.tasks()["tasks"] == []
                    assert as_bob.code() == []
            denied = cli(urls, bob, "submit", "job:run", "--code", sha256)
            assert denied.returncode == 1 and "never uploaded" in denied.stderr

            # ZooKeeper: closed to sessions without the credentials.
            root = f"/steward/{cluster.name}"
            stranger = KazooClient(hosts=zookeeper.connect_string)
            stranger.start(timeout=10)
            try:
                with pytest.raises(NoAuthError):
                    stranger.get_children(root)
                with pytest.raises(NoAuthError):
                    stranger.create(f"{root}/election/intruder", b"")
            finally:
                stranger.stop()
                stranger.close()
            insider = KazooClient(hosts=zookeeper.connect_string, auth_data=[("digest", ZK_AUTH)])
            insider.start(timeout=10)
            try:
                assert insider.get_children(root)
            finally:
                insider.stop()
                insider.close()

            # Revoking Alice's token reaches the followers.
            revoked = cli(urls, ADMIN, "token", "revoke", alice_id)
            assert revoked.returncode == 0, revoked.stderr
            wait_until(lambda: not _whoami(on_follower), 10, "the revocation on a follower")
            on_follower.close()

            # Kill -9 the leader: the new one serves Bob's token and runs his tasks.
            cluster.kill9(leader.broker_id)
            new_leader = cluster.wait_for_leader(timeout_s=30, excluding=[leader.broker_id])
            with StewardClient(cluster.urls(), token=bob, timeout_s=10) as as_bob:
                handle = as_bob.submit("sleep", {"seconds": 0})
                assert handle.wait(timeout=60)["state"] == "finished"
                assert as_bob.task(handle.id)["tenant"] == "bob"
            assert new_leader.broker_id != leader.broker_id
            cluster.wait_for_equal_digests()
        except BaseException:
            cluster.print_logs()
            raise


def _whoami(client: StewardClient) -> bool:
    try:
        return bool(client.whoami()["role"] == "tenant")
    except AuthenticationError:
        return False


def _ready(url: str, sha256: str) -> bool:
    listing = httpx.get(
        url + "/api/v1/code", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5
    ).json()
    return any(a["sha256"] == sha256 and a["ready"] for a in listing["artifacts"])
