"""Token authentication for the Pulsar standalone (clients/dev/pulsar_standalone.py; issue 31
item 4): what ``PulsarStandalone(..., token_auth=...)`` adds to its ``standalone.conf``.

Token authentication (:class:`PulsarTokenAuth`): Pulsar's ``AuthenticationProviderToken``
with an HS256 secret (``tokenSecretKey``), authorization on, one super-user role
(:data:`SUPER_USER_ROLE`). The standalone's own internal client (its health check, the
``public/default`` namespace it creates at start) authenticates with a super-user token
(``brokerClientAuthenticationPlugin``/``...Parameters``). Any other role is authenticated
but refused: nothing grants it permissions. Tokens are HS256 JWTs with a ``sub`` claim, what
``bin/pulsar tokens create --secret-key ... --subject ROLE`` makes (:func:`hs256_token`).

TLS (``tls=``, ``tls_config_lines`` in the harness): the broker's binary protocol and its web
service also on TLS ports of their own, with a certificate of tests/support/tls_certs.py
(``make_tls_files(..., for_java=True)``: RSA, a PKCS#8 key). The plain ports stay open (with
the same authentication), so the harness's readiness check does not depend on TLS.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

#: The role of the standalone's own client and of the tests' admin token.
SUPER_USER_ROLE = "steward-admin"
TOKEN_PROVIDER = "org.apache.pulsar.broker.authentication.AuthenticationProviderToken"
TOKEN_CLIENT_PLUGIN = "org.apache.pulsar.client.impl.auth.AuthenticationToken"


def _base64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def hs256_token(secret: bytes, subject: str) -> str:
    """A JWT signed with HS256 by ``secret``, claiming only ``sub`` (no expiry), as Pulsar's
    token tool makes them (RFC 7519; the header and claims are compact JSON)."""
    header = _base64url(json.dumps({"alg": "HS256"}, separators=(",", ":")).encode())
    claims = _base64url(json.dumps({"sub": subject}, separators=(",", ":")).encode())
    signing_input = f"{header}.{claims}".encode("ascii")
    signature = hmac.new(secret, signing_input, hashlib.sha256).digest()
    return f"{header}.{claims}.{_base64url(signature)}"


@dataclass(frozen=True)
class PulsarTokenAuth:
    """Token authentication with the HS256 secret ``secret`` (see the module docstring)."""

    secret: bytes
    super_user_role: str = SUPER_USER_ROLE

    @classmethod
    def generate(cls) -> PulsarTokenAuth:
        """A fresh random 256-bit secret."""
        return cls(secrets.token_bytes(32))

    def token(self, role: str | None = None) -> str:
        """A valid token for ``role`` (default: the super user)."""
        return hs256_token(self.secret, role or self.super_user_role)

    def config_lines(self) -> list[str]:
        secret = base64.b64encode(self.secret).decode("ascii")
        return [
            "authenticationEnabled=true",
            f"authenticationProviders={TOKEN_PROVIDER}",
            f"tokenSecretKey=data:;base64,{secret}",
            "authorizationEnabled=true",
            f"superUserRoles={self.super_user_role}",
            # The standalone's own client: its health check, its start-up namespaces.
            f"brokerClientAuthenticationPlugin={TOKEN_CLIENT_PLUGIN}",
            f"brokerClientAuthenticationParameters=token:{self.token()}",
        ]
