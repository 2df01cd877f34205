"""A TaskRuntime with real task processes and a collecting on_report, for the tests of
task processes (tests/security/test_task_processes.py, test_spare_processes.py).

Code artifacts are placed in the worker's cache as the download would leave them (the
cache verifies their hash before use): ``job`` is the source of the module tasks name as
``job:function``. Every wait is bounded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from clients.worker import WorkerConfig
from clients.worker.runtime.task_runtime import TaskRuntime
from wire.worker_protocol import AssignedTask, TaskReport

WAIT_S = 20.0


def work_root(tmp: Path) -> Path:
    root = Path(tempfile.mkdtemp(prefix="steward-test-work-"))
    os.chmod(root, 0o711)
    (tmp / "work-root").write_text(str(root))  # for cleanup
    return root / "work"


class Runtime:
    """A TaskRuntime with task processes and a collecting on_report."""

    def __init__(self, tmp: Path, job: str, **overrides: Any) -> None:
        settings: dict[str, Any] = {
            "broker": "127.0.0.1:1",
            "http_url": "http://127.0.0.1:1",
            "task_types": {"*": 4},
            "cache_dir": tmp / "cache",
            # Not under tmp: pytest makes its base 0700, and task users must reach this.
            "work_dir": work_root(tmp),
            "cancel_grace_s": 1.0,
            "task_process_idle_s": 30.0,
        }
        settings.update(overrides)
        self.config = WorkerConfig(**settings)
        self.reports: dict[tuple[int, int], TaskReport] = {}
        self._cond = threading.Condition()
        self.runtime = TaskRuntime(self.config, self._on_report)
        self.sha = self._install(job.encode())

    def ready_path(self, task_id: int) -> str:
        """Where a task says it runs: a directory task users can write, like /tmp."""
        ready = self.config.work_dir.parent / "ready"
        ready.mkdir(exist_ok=True)
        os.chmod(ready, 0o1777)
        return str(ready / str(task_id))

    def _install(self, code: bytes) -> str:
        sha = hashlib.sha256(code).hexdigest()
        self.config.cache_dir.mkdir(parents=True, exist_ok=True)
        (self.config.cache_dir / f"{sha}.py").write_bytes(code)
        return sha

    def _on_report(self, report: TaskReport) -> None:
        with self._cond:
            self.reports[report.task_id, report.attempt] = report
            self._cond.notify_all()
        self.runtime.forget((report.task_id, report.attempt))

    def start(
        self,
        task_id: int,
        fn: str,
        params: Any = None,
        *,
        tenant: str = "alice",
        resources: dict[str, float] | None = None,
    ) -> None:
        code = self.sha if ":" in fn else None
        self.runtime.start(
            AssignedTask(
                task_id=task_id,
                attempt=1,
                type=fn,
                tenant=tenant,
                params=json.dumps(params).encode(),
                code=code,
                resources=resources or {},
            )
        )

    def wait(self, task_id: int, timeout_s: float = WAIT_S) -> TaskReport:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (task_id, 1) not in self.reports:
                left = deadline - time.monotonic()
                assert left > 0, f"task {task_id} did not report within {timeout_s} s"
                self._cond.wait(left)
            return self.reports[task_id, 1]

    def result(self, task_id: int) -> Any:
        report = self.wait(task_id)
        assert report.ok, report.error
        assert report.result is not None
        return json.loads(report.result)

    def close(self) -> None:
        self.runtime.shutdown()
        shutil.rmtree(self.config.work_dir.parent, ignore_errors=True)
