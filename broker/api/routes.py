"""THE route table of the HTTP API: each route declared once, with its method, path,
permission, handler, request and response models and summary.

Everything else is derived from it: dispatch and the permission check
(broker/api/http_api.py), the public paths (served without credentials), the OpenAPI
document (broker/api/openapi.py) and the check of docs/API.md (tests/unit/test_routes.py).
No other module of broker/api holds a path string (a test checks).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from broker.api import api_models as m
from broker.api import (
    handlers_bulk,
    handlers_cluster,
    handlers_code,
    handlers_dashboard,
    handlers_events,
    handlers_schedules,
    handlers_tasks,
    handlers_tenants,
    handlers_tokens,
    handlers_transactions,
    handlers_trees,
    handlers_webhooks,
)
from broker.api.common import ARTIFACT_NAME_PATTERN, ApiConfig, Request
from broker.api.context import ApiContext
from broker.api.output_store import TaskLogs
from broker.security.auth import Role as CallerRole
from snapshot.peer import LATEST_SNAPSHOT_PATH, POSITION_HEADER

Handler = Callable[[ApiContext, Request], Awaitable[tuple[int, bytes]]]
# A JSON schema, or one that depends on the broker's configuration (its bounds).
Schema = dict[str, Any] | Callable[[ApiConfig], dict[str, Any]]


@dataclass(frozen=True)
class Permission:
    """Who may call a route. Admin always may; with authentication off everyone is admin."""

    name: str
    roles: tuple[CallerRole, ...] = ()  # the roles besides admin that may
    public: bool = False  # served without credentials even when authentication is on
    any_caller: bool = False  # every authenticated caller may (no role check)
    message: str | None = None  # the 403's message, when not "this needs the ... role"


PUBLIC: Final = Permission("public", public=True)
ANY: Final = Permission("any", any_caller=True)
ADMIN: Final = Permission("admin")
TENANT: Final = Permission("tenant", (CallerRole.TENANT,))
# A write that acts for a tenant (submit, begin a transaction): same roles, its own message.
TENANT_WRITE: Final = Permission(
    "tenant", (CallerRole.TENANT,), message="this needs a tenant or admin token"
)
PEER: Final = Permission("peer", (CallerRole.PEER,))
WORKER: Final = Permission("worker", (CallerRole.WORKER, CallerRole.PEER))
CODE_READER: Final = Permission(
    "tenant, worker or peer", (CallerRole.TENANT, CallerRole.WORKER, CallerRole.PEER)
)


@dataclass(frozen=True)
class Param:
    """A path, query or header parameter."""

    name: str
    where: str  # "path", "query" or "header"
    schema: Schema
    regex: str = ""  # a path parameter's: what dispatch matches
    required: bool = False


@dataclass(frozen=True)
class Content:
    """A request or response body: a JSON model, or raw bytes of the given media types."""

    model: type | None = None
    description: str = "OK"
    media: tuple[str, ...] = ("application/json",)
    headers: tuple[tuple[str, str, str], ...] = ()  # (name, description, value pattern)
    schema: dict[str, Any] | None = None  # raw bytes': default {"type": "string"}
    # A JSON body of one of these models (documented as oneOf; decoded as ``model``).
    one_of: tuple[type, ...] = ()


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI style: "/api/v1/tasks/{id}"
    permission: Permission
    handler: Handler
    summary: str
    responses: dict[int | str, Content]
    # The OpenAPI operationId (a generated client's function name) and tag (its module):
    # unique and set on every route (tests/unit/test_openapi.py checks).
    operation_id: str = ""
    tag: str = ""
    # Error statuses this route answers besides those every route may (broker/api/openapi.py).
    errors: tuple[int, ...] = ()
    params: tuple[Param, ...] = ()
    body: Content | None = None
    body_required: bool = True
    description: str | None = None
    # The largest request body taken (None: ApiConfig.max_request_bytes).
    max_body: Callable[[ApiConfig], int] | None = None

    @property
    def regex(self) -> str:
        """The path as dispatch matches it: each {param} its parameter's regex."""
        regexes = {p.name: p.regex for p in self.params if p.where == "path"}
        return re.sub(r"\{(\w+)\}", lambda found: f"({regexes[found.group(1)]})", self.path)


def _json(model: type, description: str = "OK") -> Content:
    return Content(model, description)


def _raw(description: str, *media: str) -> Content:
    return Content(None, description, media or ("application/octet-stream",))


def _query(name: str, schema: Schema, required: bool = False) -> Param:
    return Param(name, "query", schema, required=required)


def _ids(low: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": 2**62}


_ID = Param("id", "path", {"type": "integer"}, r"\d{1,18}")
_TENANT_NAME = Param("name", "path", {"type": "string", "pattern": m.NAME_PATTERN}, "[^/]+")
_SHA256 = Param("sha256", "path", {"type": "string"}, "[0-9a-f]{64}")
_TOKEN_ID = Param(
    "token_id", "path", {"type": "string", "pattern": "^[0-9a-f]{1,64}$"}, "[0-9a-f]{1,64}"
)
_SCHEDULE_NAME = Param(
    "name", "path", {"type": "string", "pattern": m.NAME_PATTERN}, "[A-Za-z0-9._-]{1,64}"
)
_ROOT = Param("root", "path", {"type": "integer"}, r"\d{1,18}")
_ASSET = Param("name", "path", {"type": "string"}, "[A-Za-z0-9_.-]{1,64}")
# The filters GET /api/v1/tasks and GET /api/v1/tasks/recent share.
_TASK_FILTERS = (
    # The TaskState schema (broker/api/openapi.py resolves the reference).
    _query("state", {"$ref": "#/components/schemas/TaskState"}),
    _query("tenant", {"type": "string"}),
    _query("type", {"type": "string"}),
    _query(
        "limit",
        lambda config: {"type": "integer", "minimum": 1, "maximum": config.max_list_limit},
    ),
)
_IDEMPOTENCY_KEY = Param(
    "Idempotency-Key",
    "header",
    {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[\\x20-\\x7e]+$"},
)
# One server-sent event of GET /api/v1/events, as the stream's fields (data: a task's view).
_TASK_EVENT: Final = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "const": "task"},
        "data": {"type": "string", "contentMediaType": "application/json"},
        "id": {"type": "string", "pattern": r"^\d{1,18}:\d{1,18}:\d{1,10}$"},
    },
    "required": ["event", "data"],
}
_OPENAPI_PATH: Final = "/api/v1/openapi.json"

ROUTES: Final[tuple[Route, ...]] = (
    Route("GET", "/healthz", PUBLIC, handlers_cluster.health, "Liveness",
          {200: _json(m.Health),
           # Health when the broker says why; the error body when its connection cap or
           # a stop answers first (broker/api/edges.py).
           503: Content(description="Not serving", one_of=(m.Health, m.ErrorBody))},
          operation_id="get_health", tag="broker"),
    Route("GET", _OPENAPI_PATH, PUBLIC, handlers_cluster.openapi, "This OpenAPI document",
          {200: Content(None, "The document", schema={"type": "object"})},
          operation_id="get_openapi_document", tag="broker"),
    # --- tasks -------------------------------------------------------------------------
    Route("POST", "/api/v1/tasks", TENANT_WRITE, handlers_tasks.submit,
          "Submit one task or a batch ({'tasks': [...]})",
          {200: _json(m.SubmitBatchResponse, "Batch results"),
           201: _json(m.TaskRefBody, "Single task accepted")},
          params=(_IDEMPOTENCY_KEY,),
          body=Content(m.SubmitBody, one_of=(m.SubmitOneBody, m.SubmitBatchBody)),
          description=(
              "Send an idempotency key (the Idempotency-Key header or the "
              "idempotency_key field, 1-128 printable ASCII characters) to retry "
              "safely: a submission repeating a key that created tasks in the last "
              "24 hours (or the finished-task retention, if longer) creates nothing "
              "and gets the same status and ids again, with replayed: true. A key "
              "reused for a different number of tasks is refused (409). Keys, like "
              "slot names, are the tenant's own: another tenant's equal key is "
              "another key."
          ),
          operation_id="submit_task", tag="tasks", errors=(409, 413, 429)),
    Route("GET", "/api/v1/tasks", TENANT, handlers_tasks.list_tasks,
          "List tasks (ascending id, paginate with after)", {200: _json(m.TaskList)},
          params=(*_TASK_FILTERS, _query("after", _ids(0))),
          operation_id="list_tasks", tag="tasks"),
    Route("GET", "/api/v1/tasks/{id}", TENANT, handlers_tasks.get_task,
          "One task (with its tree's status when it roots a tracked tree)",
          {200: _json(m.TaskView)},
          params=(
              _ID,
              _query("wait_s", lambda config: {
                  "type": "number", "minimum": 0, "maximum": config.max_wait_s}),
              _query("wait_tree", {"type": "boolean"}),
          ),
          operation_id="get_task", tag="tasks"),
    Route("POST", "/api/v1/tasks/cancel", TENANT, handlers_bulk.cancel_tasks,
          "Cancel the live tasks matching a filter", {200: _json(m.BulkCancelResult)},
          body=Content(m.BulkCancelBody),
          description=(
              "Tenant-scoped (an admin: any tenant, or all). At least one filter; the "
              "matching ids are cancelled in batches of 1,000, one log entry each."
          ),
          operation_id="cancel_tasks", tag="tasks"),
    Route("POST", "/api/v1/tasks/{id}/cancel", TENANT, handlers_tasks.cancel_task,
          "Cancel a live task", {200: _json(m.TaskRefBody)}, params=(_ID,),
          operation_id="cancel_task", tag="tasks", errors=(409,)),
    Route("GET", "/api/v1/tasks/{id}/logs", TENANT, handlers_tasks.task_logs,
          "An attempt's captured stdout, stderr and ctx.logger output", {200: _json(TaskLogs)},
          params=(_ID, _query("attempt", _ids(1)), _query("offset", _ids(0))),
          description=(
              "The last 1 MiB of each attempt run in a task process, as the worker "
              "ships it (about once a second while it runs). Tenant-scoped like "
              "GET /api/v1/tasks/{id}. Pass next_offset back as offset to get only "
              "newer output; complete: the attempt writes no more. Kept by the "
              "leader (a follower asks it)."
          ),
          operation_id="get_task_logs", tag="tasks"),
    Route("GET", "/api/v1/tasks/recent", TENANT, handlers_tasks.recent_tasks,
          "Search tasks, newest first (paginate with before)", {200: _json(m.RecentTaskList)},
          params=(*_TASK_FILTERS, _query("before", _ids(1))),
          operation_id="search_recent_tasks", tag="tasks"),
    Route("GET", "/api/v1/events", TENANT, handlers_events.task_events,
          "Server-sent events: tasks once they are final (text/event-stream)",
          {200: Content(None, "The event stream (docs/API.md, Task events)",
                        ("text/event-stream",), schema=_TASK_EVENT),
           410: _json(m.ErrorBody, "Last-Event-ID is older than the events this broker "
                      "holds"),
           503: _json(m.ErrorBody, "Too many event streams on this broker; retry later")},
          params=(
              _query("tasks", {"type": "string", "pattern": r"^\d{1,18}(,\d{1,18})*$"}),
              _query("tenant", {"type": "string"}),
              _query("tree", _ids(0)),
              _query("states", {"type": "string",
                                "pattern": r"^(finished|error|cancelled)"
                                           r"(,(finished|error|cancelled))*$"}),
              _query("wait_s", lambda config: {
                  "type": "number", "minimum": 0, "maximum": config.max_wait_s}),
              Param("Last-Event-ID", "header", {
                  "type": "string", "pattern": r"^-?\d{1,18}:-?\d{1,18}(:\d{1,10})?$"}),
          ),
          description=(
              "With tasks (comma-separated ids, at most max_event_tasks, default 10,000; "
              "each must be one the caller may GET, else 404 before the stream starts): "
              "one 'task' event per named task whose data is the task's view as GET "
              "/api/v1/tasks/{id} returns it, at once for a task already final, else "
              "when it becomes final; the stream ends once every task was reported. "
              "Without tasks, the feed: every task becoming final (filtered by tenant, "
              "admin only: a tenant token sees its own; tree, a root id; states) in log "
              "order, from Last-Event-ID (replayed; 410 when older than the events this "
              "broker holds) or from now. An event's id is LEDGER:ENTRY:INDEX, the log "
              "position of the entry that made the task final and the task's index among "
              "those it made final (absent for tasks already final when a tasks stream "
              "opened). A ': keep-alive' comment every 15 s; every stream ends after "
              "wait_s (default 60). Served by followers too."
          ),
          operation_id="stream_task_events", tag="tasks"),
    # --- task trees --------------------------------------------------------------------
    Route("GET", "/api/v1/trees", TENANT, handlers_trees.get_trees,
          "List tracked task trees by state (ascending root id, paginate with after)",
          {200: _json(m.TreeList)},
          params=(
              _query("state", {"type": "string",
                               "enum": ["pending", "completed", "failed", "timed_out"]}),
              _query("tenant", {"type": "string"}),
              _query("limit", lambda config: {
                  "type": "integer", "minimum": 1, "maximum": config.max_list_limit}),
              _query("after", _ids(0)),
          ),
          description=(
              "Trees whose root task is still kept (a root outlives its tree's end by the "
              "finished-task retention). A tenant token lists its own tenant's; an admin "
              "every tenant's, or one with tenant. timed_out: failed for good because "
              "its last run timed out (failed: any other failure)."
          ),
          operation_id="list_trees", tag="trees"),
    Route("GET", "/api/v1/trees/{root}", TENANT, handlers_trees.get_tree,
          "One tracked tree: state, age, timeout, its tasks by state, pending anchors",
          {200: _json(m.TreeDetail)}, params=(_ROOT,),
          operation_id="get_tree", tag="trees"),
    # --- transactions ------------------------------------------------------------------
    Route("POST", "/api/v1/transactions", TENANT_WRITE,
          handlers_transactions.begin_transaction, "Begin a transaction",
          {201: _json(m.TransactionView)}, body=Content(m.TransactionBegin), body_required=False,
          operation_id="begin_transaction", tag="transactions", errors=(409,)),
    Route("POST", "/api/v1/transactions/{id}/commit", TENANT,
          handlers_transactions.commit_transaction,
          "Commit: all its tasks become waiting at once", {200: _json(m.TransactionOutcome)},
          params=(_ID,),
          operation_id="commit_transaction", tag="transactions", errors=(409, 429)),
    Route("POST", "/api/v1/transactions/{id}/rollback", TENANT,
          handlers_transactions.rollback_transaction,
          "Roll back: its tasks are dropped", {200: _json(m.TransactionOutcome)},
          params=(_ID,),
          operation_id="rollback_transaction", tag="transactions", errors=(409,)),
    # --- schedules (periodic tasks) ---------------------------------------------------
    Route("POST", "/api/v1/schedules", TENANT_WRITE, handlers_schedules.create_schedule,
          "Create a schedule: a task created at each tick of a cron expression or interval",
          {201: _json(m.ScheduleView)}, body=Content(m.ScheduleCreate),
          description=(
              "Give cron (5 fields, or 6 with seconds; UTC) or interval_s (1 s to 366 "
              "days; the first tick is one interval after creation). The leader fires each "
              "tick once, across failovers: one log entry creates the tick's task and moves "
              "the schedule on. missed says what happens to ticks no leader fired in time: "
              "skip (default: a tick reached more than grace_s late is dropped; of several "
              "overdue ticks only the latest can run), run_once (several overdue ticks run "
              "once) or run_all (each runs, at most the latest 100). Names are the "
              "tenant's own; 409 when the name is taken."
          ),
          operation_id="create_schedule", tag="schedules", errors=(409, 413)),
    Route("GET", "/api/v1/schedules", TENANT, handlers_schedules.list_schedules,
          "List schedules (a tenant token: its own)", {200: _json(m.ScheduleList)},
          params=(_query("tenant", {"type": "string"}),),
          operation_id="list_schedules", tag="schedules"),
    Route("GET", "/api/v1/schedules/{name}", TENANT, handlers_schedules.get_schedule,
          "One schedule, with its last firings", {200: _json(m.ScheduleView)},
          params=(_SCHEDULE_NAME, _query("tenant", {"type": "string"})),
          operation_id="get_schedule", tag="schedules"),
    Route("DELETE", "/api/v1/schedules/{name}", TENANT, handlers_schedules.delete_schedule,
          "Delete a schedule (the tasks it created stay)", {200: _json(m.ScheduleView)},
          params=(_SCHEDULE_NAME, _query("tenant", {"type": "string"})),
          operation_id="delete_schedule", tag="schedules"),
    Route("POST", "/api/v1/schedules/{name}/pause", TENANT, handlers_schedules.pause_schedule,
          "Pause a schedule: it fires nothing until resumed", {200: _json(m.ScheduleView)},
          params=(_SCHEDULE_NAME, _query("tenant", {"type": "string"})),
          description=(
              "Ticks that pass while it is paused are missed: once resumed, the schedule's "
              "missed policy handles them (skip, run_once or run_all, as for ticks no "
              "leader fired in time). Pausing a paused schedule changes nothing."
          ),
          operation_id="pause_schedule", tag="schedules"),
    Route("POST", "/api/v1/schedules/{name}/resume", TENANT, handlers_schedules.resume_schedule,
          "Resume a paused schedule (its missed policy handles the ticks passed meanwhile)",
          {200: _json(m.ScheduleView)},
          params=(_SCHEDULE_NAME, _query("tenant", {"type": "string"})),
          operation_id="resume_schedule", tag="schedules"),
    # --- tenants -----------------------------------------------------------------------
    Route("GET", "/api/v1/tenants", TENANT, handlers_tenants.list_tenants,
          "Every tenant's service level and task counts", {200: _json(m.TenantList)},
          operation_id="list_tenants", tag="tenants"),
    Route("GET", "/api/v1/tenants/{name}", TENANT, handlers_tenants.get_tenant,
          "A tenant's service level and task counts", {200: _json(m.TenantView)},
          params=(_TENANT_NAME,),
          operation_id="get_tenant", tag="tenants"),
    Route("PUT", "/api/v1/tenants/{name}", ADMIN, handlers_tenants.put_tenant,
          "Change a tenant's service level (effective at once)", {200: _json(m.TenantView)},
          params=(_TENANT_NAME,), body=Content(m.TenantLimits),
          operation_id="update_tenant", tag="tenants", errors=(409,)),
    Route("GET", "/api/v1/tenants/{name}/webhook", TENANT, handlers_webhooks.get_webhook,
          "A tenant's webhook (its URL and delivery position, never its secret)",
          {200: _json(m.WebhookView)}, params=(_TENANT_NAME,),
          operation_id="get_tenant_webhook", tag="tenants"),
    Route("PUT", "/api/v1/tenants/{name}/webhook", TENANT_WRITE, handlers_webhooks.put_webhook,
          "Set a tenant's webhook: each completion event after now is POSTed to url, signed",
          {200: _json(m.WebhookView)}, params=(_TENANT_NAME,), body=Content(m.WebhookBody),
          description=(
              "The leader POSTs each of the tenant's completion events (the task's view) "
              "to url, in log order, with X-Steward-Event-Id and X-Steward-Signature "
              "(sha256=HMAC-SHA256 of the body under secret, hex); retried with "
              "exponential backoff until a 2xx answer: at least once, across fail-overs "
              "(docs/API.md, Webhooks)."
          ),
          operation_id="set_tenant_webhook", tag="tenants"),
    Route("DELETE", "/api/v1/tenants/{name}/webhook", TENANT_WRITE,
          handlers_webhooks.delete_webhook, "Remove a tenant's webhook (answers it as it was)",
          {200: _json(m.WebhookView)}, params=(_TENANT_NAME,),
          operation_id="delete_tenant_webhook", tag="tenants"),
    # --- code artifacts ----------------------------------------------------------------
    Route("POST", "/api/v1/code", TENANT, handlers_code.upload_code,
          "Upload a code artifact (.py, .zip or wheel; the raw bytes as body)",
          {201: _json(m.ArtifactView)},
          params=(_query("name", {"type": "string", "pattern": ARTIFACT_NAME_PATTERN}, True),),
          body=_raw("The artifact's bytes"),
          max_body=lambda config: config.max_code_bytes,
          description=(
              "Checked in a separate, memory- and time-limited process: a .py must"
              " compile (nothing runs); a zip is inflated in chunks and counted. 413"
              " past a bound (.py size, zip entries, inflated size, compression ratio),"
              " 400 invalid_artifact otherwise."
          ),
          operation_id="upload_code", tag="code", errors=(413,)),
    Route("GET", "/api/v1/code", CODE_READER, handlers_code.list_code,
          "Every code artifact", {200: _json(m.ArtifactList)},
          operation_id="list_code", tag="code"),
    Route("GET", "/api/v1/code/{sha256}", CODE_READER, handlers_code.download_code,
          "Download a code artifact by its sha256", {200: _raw("The artifact's bytes")},
          params=(_SHA256,),
          operation_id="download_code", tag="code"),
    Route("DELETE", "/api/v1/code/{sha256}", TENANT, handlers_code.delete_code,
          "Delete a code artifact (its uploading tenant or an admin)",
          {200: _json(m.ArtifactView)}, params=(_SHA256,),
          description=(
              "Logged; every broker removes the file once applied and workers drop it"
              " from their caches. 409 while a pending, delayed, waiting or running task"
              " uses it (the answer names them). A tenant's delete of an artifact other"
              " tenants uploaded too drops only its own claim."
          ),
          operation_id="delete_code", tag="code", errors=(409,)),
    # --- cluster and this broker -------------------------------------------------------
    Route("GET", "/api/v1/cluster", WORKER, handlers_cluster.cluster, "Cluster summary",
          {200: _json(m.ClusterSummary)},
          operation_id="get_cluster", tag="cluster"),
    Route("GET", "/api/v1/config", ADMIN, handlers_cluster.get_config,
          "Replicated cluster settings", {200: _json(m.ClusterConfigView)},
          operation_id="get_config", tag="cluster"),
    Route("PUT", "/api/v1/config", ADMIN, handlers_cluster.put_config,
          "Change global resource limits or the finished-task retention",
          {200: _json(m.ClusterConfigView)}, body=Content(m.ClusterConfigPatch),
          operation_id="update_config", tag="cluster"),
    Route("GET", "/api/v1/state/digest", PEER, handlers_cluster.digest,
          "Digest of the replicated state at the applied position", {200: _json(m.DigestBody)},
          operation_id="get_state_digest", tag="cluster"),
    Route("GET", "/metrics", PEER, handlers_cluster.metrics,
          "Prometheus metrics of this broker (text exposition format 0.0.4)",
          {200: _raw("Metric families (see docs/API.md, Metrics)", "text/plain")},
          operation_id="get_metrics", tag="broker"),
    # GET only: a body is never read, and the answer may be tens of MB (one response).
    Route("GET", LATEST_SNAPSHOT_PATH, PEER, handlers_cluster.latest_snapshot,
          "This broker's newest snapshot file (for a peer that has none)",
          {200: Content(None, "The snapshot file's bytes, verified by the reader",
                        ("application/octet-stream",),
                        ((POSITION_HEADER, "Log position it reflects: ledger_id:entry_id",
                          r"^\d+:\d+$"),))},
          operation_id="get_latest_snapshot", tag="cluster"),
    # --- the web dashboard: its page and files (public: they hold no data; the page reads
    # the API with the user's token) and read-only views for it ------------------------
    Route("GET", "/", PUBLIC, handlers_dashboard.dashboard_page,
          "The web dashboard (an HTML page)", {200: _raw("The page", "text/html")},
          operation_id="get_dashboard_page", tag="dashboard"),
    Route("GET", "/dashboard/{name}", PUBLIC, handlers_dashboard.dashboard_asset,
          "The dashboard's script, style sheet and icon",
          {200: _raw("The file", "text/javascript", "text/css", "image/svg+xml")},
          params=(_ASSET,),
          operation_id="get_dashboard_asset", tag="dashboard"),
    Route("GET", "/api/v1/cluster/brokers", ADMIN, handlers_dashboard.broker_statuses,
          "Every live broker's own role and log position, and its lag",
          {200: _json(m.BrokerStatusList)},
          description=(
              "The answering broker asks each peer's /healthz (1 s timeout); a peer that "
              "does not answer is listed as unreachable. lag_entries: entries behind "
              "the leader's position when both are in the same ledger (an idle "
              "leader's last entry is a Confirm marker that followers apply only "
              "with the next entry, so 1 means in sync)."
          ),
          operation_id="list_brokers", tag="cluster"),
    Route("GET", "/api/v1/workers", ADMIN, handlers_dashboard.list_workers,
          "Every worker with its capacities and the tasks running on it",
          {200: _json(m.WorkerList)},
          operation_id="list_workers", tag="workers"),
    Route("GET", "/api/v1/stats/throughput", ADMIN, handlers_dashboard.throughput_stats,
          "Tasks submitted, finished, failed, cancelled per recent time bucket",
          {200: _json(m.ThroughputView)},
          operation_id="get_throughput", tag="stats"),
    # --- API tokens (admin) and the caller -----------------------------------------------
    Route("POST", "/api/v1/tokens", ADMIN, handlers_tokens.create_token,
          "Issue an API token (admin); the secret is in this answer only",
          {201: _json(m.TokenCreated)}, body=Content(m.TokenCreate),
          operation_id="create_token", tag="tokens"),
    Route("GET", "/api/v1/tokens", ADMIN, handlers_tokens.list_tokens,
          "Every API token, without secrets (admin)", {200: _json(m.TokenList)},
          operation_id="list_tokens", tag="tokens"),
    Route("DELETE", "/api/v1/tokens/{token_id}", ADMIN, handlers_tokens.revoke_token,
          "Revoke an API token (admin)", {200: _json(m.TokenView)}, params=(_TOKEN_ID,),
          operation_id="revoke_token", tag="tokens"),
    Route("GET", "/api/v1/whoami", ANY, handlers_tokens.whoami,
          "The caller's role and tenant", {200: _json(m.WhoAmI)},
          operation_id="whoami", tag="tokens"),
)  # fmt: skip

PUBLIC_PATHS: Final = frozenset(r.path for r in ROUTES if r.permission.public)
