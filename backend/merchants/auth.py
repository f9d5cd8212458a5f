"""Bearer API-key authentication for ``/api/v1``."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import wraps
from typing import Any

from flask import g, request

from backend import appstate
from backend.errors import DomainError
from backend.merchants.services import authenticate
from backend.ratelimit import client_key, enforce

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="payintent"'}


def api_key_required(view: Callable[..., Any]) -> Callable[..., Any]:
    """Resolve ``Authorization: Bearer sk_test_...`` to ``g.merchant_id`` or answer 401."""

    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = appstate.settings()
        client = client_key()
        enforce(f"api:ip:{client}", settings.api_requests_per_minute_per_ip)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            enforce(f"api:auth-failures:{client}", settings.api_auth_failures_per_minute)
            raise DomainError(
                "UNAUTHORIZED", "Missing API key: send 'Authorization: Bearer sk_test_...'", headers=_CHALLENGE
            )
        merchant_id = authenticate(token)
        if merchant_id is None:
            enforce(f"api:auth-failures:{client}", settings.api_auth_failures_per_minute)  # key guessing
            raise DomainError("UNAUTHORIZED", "Invalid or revoked API key", headers=_CHALLENGE)
        digest = hashlib.sha256(token.encode()).hexdigest()[:32]  # never the key itself, even in Redis
        enforce(f"api:key:{digest}", settings.api_requests_per_minute_per_key)
        g.merchant_id = merchant_id
        return view(*args, **kwargs)

    return wrapper


def current_merchant_id() -> str:
    merchant_id: str = g.merchant_id  # set by api_key_required
    return merchant_id
