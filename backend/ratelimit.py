"""Rate limits: the one place requests are counted per client (public checkout API, dashboard logins).

A fixed window that starts at the first request; counts live in ``backend.ephemeral`` (Redis when
configured and shared by every API process, else per process).
"""

from __future__ import annotations

from backend.ephemeral import store


def hit(key: str, limit: int, window_seconds: int) -> int | None:
    """Count one request for ``key``; None if allowed, else the seconds until the window resets."""
    counters = store()
    name = f"rl:{key}"
    if counters.incr(name, window_seconds) <= limit:
        return None
    _, resets_in = counters.count(name)
    return max(1, resets_in)
