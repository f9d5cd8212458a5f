"""Bearer API-key authentication for ``/api/v1``."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from flask import g, request

from backend.errors import APIError
from backend.merchants.services import authenticate

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="payintent"'}


def api_key_required(view: Callable[..., Any]) -> Callable[..., Any]:
    """Resolve ``Authorization: Bearer sk_test_...`` to ``g.merchant_id`` or answer 401."""

    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401, "UNAUTHORIZED", "Missing API key: send 'Authorization: Bearer sk_test_...'", headers=_CHALLENGE
            )
        merchant_id = authenticate(token)
        if merchant_id is None:
            raise APIError(401, "UNAUTHORIZED", "Invalid or revoked API key", headers=_CHALLENGE)
        g.merchant_id = merchant_id
        return view(*args, **kwargs)

    return wrapper


def current_merchant_id() -> str:
    return g.merchant_id  # type: ignore[no-any-return]
