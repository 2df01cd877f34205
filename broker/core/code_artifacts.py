"""The state machine's code artifacts: uploads, owners and readiness; tasks waiting for an
artifact that is not ready are parked on it (docs/DESIGN.md §7).
"""

from __future__ import annotations

from broker.core import entries as e
from broker.core.entries import SHA256_RE
from broker.core.machine_base import MachineBase
from broker.core.records import (
    Artifact,
    ArtifactUpload,
    ErrorCode,
    Rejected,
)
from broker.core.validation import (
    NAME_RE,
)


class CodeArtifactsMixin(MachineBase):
    """AddCode and CodeReady; parked tasks released when their code is ready."""

    def _add_code(self, entry: e.AddCode) -> Artifact | Rejected:
        if not SHA256_RE.fullmatch(entry.sha256):
            return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
        if entry.size_bytes < 0:
            return Rejected(ErrorCode.INVALID, "size_bytes must be >= 0")
        if entry.tenant is not None and not NAME_RE.match(entry.tenant):
            return Rejected(ErrorCode.INVALID, f"tenant name {entry.tenant!r} is not valid")
        artifact = self.artifacts.get(entry.sha256)
        if artifact is None:
            artifact = self.artifacts[entry.sha256] = Artifact(
                entry.sha256,
                entry.name,
                entry.size_bytes,
                self.now_ms,
                entry.ready,
                [entry.tenant] if entry.tenant is not None else [],
            )
        else:
            if entry.ready and not artifact.ready:
                # Uploaded again by a leader that needs no replicas first: no reason to wait.
                self._release_code(artifact)
            if entry.tenant is None:
                if artifact.owners:
                    # An admin upload shares it with every tenant: they are shown the
                    # admin's name and time, not those of the tenant that uploaded first.
                    artifact.name, artifact.created_ms = entry.name, self.now_ms
                artifact.owners = []
            elif artifact.owners and entry.tenant not in artifact.owners:
                artifact.owners = sorted([*artifact.owners, entry.tenant])
        if entry.tenant is not None and artifact.upload_of(entry.tenant) is None:
            artifact.uploads.append(ArtifactUpload(entry.tenant, entry.name, self.now_ms))
        return artifact

    def _code_ready(self, entry: e.CodeReady) -> Artifact | Rejected:
        if not SHA256_RE.fullmatch(entry.sha256):
            return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
        artifact = self.artifacts.get(entry.sha256)
        if artifact is None:
            return Rejected(ErrorCode.NOT_FOUND, f"code artifact {entry.sha256} is unknown")
        if not artifact.ready:
            self._release_code(artifact)
        return artifact

    def _release_code(self, artifact: Artifact) -> None:
        """Mark an artifact ready; its parked tasks join their queues, in id order."""
        artifact.ready = True
        parked = self.parked.pop(artifact.sha256, None)
        if parked:
            tasks = self.tasks
            for task_id in sorted(parked):
                self._queue(tasks[task_id])
