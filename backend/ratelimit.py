"""Rate limits: the one place requests are counted per client (API keys, client IPs, the public
checkout API, dashboard logins) and the one place a 429 is answered.

A fixed window that starts at the first request; counts live in ``backend.ephemeral`` (Redis when
configured and shared by every API process, else per process). Limits of 0 are off.
"""

from __future__ import annotations

from backend.ephemeral import store
from backend.errors import APIError


def hit(key: str, limit: int, window_seconds: int) -> int | None:
    """Count one request for ``key``; None if allowed, else the seconds until the window resets."""
    counters = store()
    name = f"rl:{key}"
    if counters.incr(name, window_seconds) <= limit:
        return None
    _, resets_in = counters.count(name)
    return max(1, resets_in)


def enforce(key: str, per_minute: int) -> None:
    """Count one request for ``key``; 429 RATE_LIMITED with Retry-After past ``per_minute`` (0: no limit)."""
    if per_minute <= 0:
        return
    retry_after = hit(key, per_minute, 60)
    if retry_after is not None:
        raise APIError(
            429, "RATE_LIMITED", "Too many requests; try again shortly", headers={"Retry-After": str(retry_after)}
        )
