"""Fixed-window rate limits: the one place requests are counted per client.

Counts live in Redis when it is configured (shared by every API process); without Redis (tests,
a single-process setup) an in-process counter is used instead, which limits per process only.
"""

from __future__ import annotations

import threading
import time

from backend.queueing import app_redis

_local: dict[str, tuple[int, float]] = {}
_lock = threading.Lock()


def hit(key: str, limit: int, window_seconds: int) -> int | None:
    """Count one request for ``key``; None if allowed, else the seconds until the window resets."""
    now = time.time()
    window = int(now // window_seconds)
    name = f"payintent:rl:{key}:{window}"
    retry_after = max(1, int((window + 1) * window_seconds - now))
    redis = app_redis(fast=True)
    if redis is not None:
        try:
            pipe = redis.pipeline()
            pipe.incr(name)
            pipe.expire(name, window_seconds + 1)
            count = int(pipe.execute()[0])
            return None if count <= limit else retry_after
        except Exception:  # Redis trouble must not take the API down: fall back to counting here
            pass
    with _lock:
        count, expires = _local.get(name, (0, now + window_seconds))
        if len(_local) > 10_000:
            for stale in [k for k, (_, exp) in _local.items() if exp < now]:
                del _local[stale]
        _local[name] = (count + 1, expires)
    return None if count + 1 <= limit else retry_after
