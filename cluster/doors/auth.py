"""The bearer token both doors check: ``authorization: Bearer <token>``, the scheme in any case (RFC 7235
2.1), compared in constant time. Health checks stay open unless ``gateway.health_requires_auth``."""

from __future__ import annotations

import hmac
import os

from cluster.config import ConfigError, GatewayConfig


def auth_token(g: GatewayConfig) -> str | None:
    """The token every call must carry, or None when the gateway is open. Raises ConfigError when the
    configured variable is unset (preflight says so before anything starts; this guards later starts)."""
    if not g.auth_token_env:
        return None
    token = os.environ.get(g.auth_token_env)
    if not token:
        raise ConfigError(f"gateway.auth_token_env: the environment variable {g.auth_token_env} is not set")
    return token


def bearer_ok(authorization: str, token: str) -> bool:
    """Whether an ``authorization`` header value carries ``token`` in the Bearer scheme."""
    scheme, _, credentials = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token.encode())
