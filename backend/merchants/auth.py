"""Bearer API-key authentication for ``/api/v1``."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from flask import g, request

from backend import appstate
from backend.errors import DomainError
from backend.merchants.services import authenticate, hash_api_key
from backend.ratelimit import client_key, enforce, enforce_and_count_ahead, enforce_counted

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="payintent"'}
T = TypeVar("T")


def authenticated(lookup: Callable[[str], tuple[str | None, T]]) -> T:
    """Authenticate the request's ``Authorization: Bearer sk_test_...``: sets ``g.merchant_id``, or answers 401.

    ``lookup(secret)`` checks the key: (the merchant id of the active key, or None; what else it read in the same
    statement, which this returns). The limits, in order: the client's (IP) requests before the key is looked
    up, its failed keys after a failure, the key's requests after a success. When the key's window is already open
    its counter is incremented before the lookup, in the IP's round trip to the counters
    (:func:`ratelimit.enforce_and_count_ahead`); only its decision waits for the lookup."""
    settings = appstate.settings()
    client = client_key()
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        enforce(f"api:ip:{client}", settings.api_requests_per_minute_per_ip)
        enforce(f"api:auth-failures:{client}", settings.api_auth_failures_per_minute)
        raise DomainError(
            "UNAUTHORIZED", "Missing API key: send 'Authorization: Bearer sk_test_...'", headers=_CHALLENGE
        )
    key_limit = f"api:key:{hash_api_key(token)[:32]}"  # never the key itself, even in Redis
    counted = enforce_and_count_ahead(
        f"api:ip:{client}", settings.api_requests_per_minute_per_ip, key_limit, settings.api_requests_per_minute_per_key
    )
    merchant_id, found = lookup(token)
    if merchant_id is None:
        enforce(f"api:auth-failures:{client}", settings.api_auth_failures_per_minute)  # key guessing
        raise DomainError("UNAUTHORIZED", "Invalid or revoked API key", headers=_CHALLENGE)
    enforce_counted(key_limit, settings.api_requests_per_minute_per_key, counted)
    g.merchant_id = merchant_id
    return found


def _key_only(secret: str) -> tuple[str | None, None]:
    return authenticate(secret), None


def api_key_required(view: Callable[..., Any]) -> Callable[..., Any]:
    """Resolve ``Authorization: Bearer sk_test_...`` to ``g.merchant_id`` or answer 401."""

    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        authenticated(_key_only)
        return view(*args, **kwargs)

    return wrapper


def api_key_reading(lookup: Callable[[str], tuple[str | None, Any]]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """:func:`api_key_required` whose key check is ``lookup`` (see :func:`authenticated`), which reads more in the
    same statement; what it read is :func:`read_with_key`'s."""

    def decorator(view: Callable[..., T]) -> Callable[..., T]:
        @wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            g.read_with_key = authenticated(lookup)
            return view(*args, **kwargs)

        return wrapper

    return decorator


def read_with_key() -> Any:
    return g.read_with_key  # set by api_key_reading


def current_merchant_id() -> str:
    merchant_id: str = g.merchant_id  # set by api_key_required
    return merchant_id
