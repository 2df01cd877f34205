"""The Pulsar admin REST API as the ledger store uses it: delete a ledger's topic, list the
ledgers' topics, check and set the namespace's policies (package docstring)."""

from __future__ import annotations

import ssl
from typing import Any

import httpx

from log.pulsar.client import PulsarPolicyError, logger
from log.pulsar.config import PulsarConfig


class PulsarAdmin:
    """An admin API client, made at its first use (only when ``config.admin_url`` is set,
    except for :meth:`ensure_namespace_retention`, which then only logs)."""

    def __init__(
        self, config: PulsarConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    # -- admin REST API --------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            config = self.config
            assert config.admin_url is not None
            headers = {}
            if config.auth_token:
                headers["Authorization"] = f"Bearer {config.auth_token}"
            self._http = httpx.AsyncClient(
                base_url=config.admin_url.rstrip("/"),
                headers=headers,
                timeout=config.operation_timeout_s,
                verify=_tls_context(config),
                transport=self._transport,
            )
        return self._http

    def _topic_path(self, ledger_id: int) -> str:
        config = self.config
        return (
            f"/admin/v2/persistent/{config.tenant}/{config.namespace}/"
            f"{config.topic_name(ledger_id)}"
        )

    async def delete_topic(self, ledger_id: int) -> None:
        try:
            # force: the topic may still have our readers or a fenced producer attached.
            response = await self._client().delete(
                self._topic_path(ledger_id), params={"force": "true"}
            )
        except httpx.HTTPError as exc:
            logger.warning("ledger %d: admin API delete failed: %s", ledger_id, exc)
            return
        if response.status_code not in (200, 204, 404):
            logger.warning(
                "ledger %d: admin API delete answered %d: %s",
                ledger_id,
                response.status_code,
                response.text[:200],
            )

    async def list_ledgers(self) -> list[int]:
        config = self.config
        try:
            response = await self._client().get(
                f"/admin/v2/persistent/{config.tenant}/{config.namespace}"
            )
            response.raise_for_status()
            topics = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("cannot list topics through the admin API: %s", exc)
            return []
        ids = [config.ledger_id_of(topic) for topic in topics if isinstance(topic, str)]
        return [ledger_id for ledger_id in ids if ledger_id is not None]

    async def ensure_namespace_retention(self) -> None:
        """Check the namespace's policies and apply what the backend needs (package doc).

        Without an admin URL this only logs that it cannot check. Raises
        :class:`PulsarPolicyError` when the admin API refuses or the namespace is missing.
        """
        config = self.config
        namespace = f"{config.tenant}/{config.namespace}"
        if config.admin_url is None:
            logger.info(
                "no Pulsar admin URL: not checking namespace %s; it must have infinite "
                "retention and no inactive-topic deletion (see log/pulsar/__init__.py)",
                namespace,
            )
            return
        base = f"/admin/v2/namespaces/{namespace}"
        policies = await self._json("GET", base, None, f"read the policies of {namespace}")
        if not isinstance(policies, dict):
            raise PulsarPolicyError(f"unexpected policies of namespace {namespace}: {policies!r}")
        retention = policies.get("retention_policies") or {}
        if (
            retention.get("retentionTimeInMinutes") != -1
            or retention.get("retentionSizeInMB") != -1
        ):
            await self._json(
                "POST",
                f"{base}/retention",
                {"retentionTimeInMinutes": -1, "retentionSizeInMB": -1},
                f"set infinite retention on {namespace}",
            )
            logger.info("namespace %s: retention set to infinite (was %s)", namespace, retention)
        inactive = policies.get("inactive_topic_policies")
        if not isinstance(inactive, dict) or inactive.get("deleteWhileInactive", True):
            await self._json(
                "POST",
                f"{base}/inactiveTopicPolicies",
                {
                    "inactiveTopicDeleteMode": "delete_when_no_subscriptions",
                    "maxInactiveDurationSeconds": 3600,
                    "deleteWhileInactive": False,
                },
                f"disable inactive-topic deletion on {namespace}",
            )
            logger.info("namespace %s: inactive-topic deletion disabled", namespace)

    async def _json(self, method: str, path: str, body: Any, what: str) -> Any:
        try:
            response = await self._client().request(method, path, json=body)
        except httpx.HTTPError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise PulsarPolicyError(
                    f"cannot {what}: the admin API's TLS certificate is not trusted ({exc}); "
                    "give the CA that signed it (--pulsar-tls-ca-file, "
                    "PulsarConfig.tls_trust_certs_file)"
                ) from exc
            raise PulsarPolicyError(f"cannot {what}: admin API unreachable: {exc}") from exc
        if response.status_code in (401, 403):
            reason = _reason(response)
            if not self.config.auth_token:
                hint = (
                    "Pulsar wants an auth token: give one (--pulsar-token or STEWARD_PULSAR_TOKEN)"
                )
            else:
                hint = (
                    "give a token Pulsar accepts whose role has admin rights on tenant "
                    f"{self.config.tenant}, or apply the policy by hand (log/pulsar/__init__.py)"
                )
            raise PulsarPolicyError(
                f"cannot {what}: the admin API refused ({response.status_code}: {reason}); {hint}"
            )
        if response.status_code == 404:
            raise PulsarPolicyError(
                f"cannot {what}: not found (404); create the tenant and namespace first "
                f"(pulsar-admin namespaces create {self.config.tenant}/{self.config.namespace})"
            )
        if response.status_code >= 300:
            raise PulsarPolicyError(
                f"cannot {what}: admin API answered {response.status_code}: {response.text[:200]}"
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise PulsarPolicyError(f"cannot {what}: the answer is not JSON") from exc


def _tls_context(config: PulsarConfig) -> ssl.SSLContext | bool:
    """How the admin client verifies ``https://`` (and which client certificate it shows)."""
    if config.tls_allow_insecure_connection:
        return False
    client_cert = config.tls_certificate_file and config.tls_private_key_file
    if not (config.tls_trust_certs_file or client_cert) and config.tls_validate_hostname:
        return True  # httpx's own default
    try:
        context = ssl.create_default_context(cafile=config.tls_trust_certs_file)
        context.check_hostname = config.tls_validate_hostname
        if config.tls_certificate_file and config.tls_private_key_file:
            context.load_cert_chain(config.tls_certificate_file, config.tls_private_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise PulsarPolicyError(f"cannot load the TLS files for the admin API: {exc}") from exc
    return context


def _reason(response: httpx.Response) -> str:
    """Pulsar's ``{"reason": ...}`` of an error answer, else the HTTP reason phrase (its
    authentication filter answers an HTML page), on one line."""
    try:
        body = response.json()
    except ValueError:
        body = None
    reason = body.get("reason") if isinstance(body, dict) else None
    text = str(reason) if reason else response.reason_phrase
    return " ".join(text.split())[:200]
