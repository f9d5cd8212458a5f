"""Short-lived counters and flags: rate limits (login throttling, the public checkout API) and
logged-out dashboard sessions.

Backed by Redis (``backend.queueing.app_redis()``) when REDIS_URL is configured, so every API
process shares them. Without Redis an in-process fallback is used, which is per process: with
several gunicorn workers and no Redis, each worker counts login failures on its own (the limit
becomes "5 per worker") and a logout is only remembered by the worker that served it. A Redis
error falls back to the in-process store for that call (logged), so the dashboard keeps working.
Nothing here is durable: losing it only resets throttles early.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from redis import Redis, RedisError

from backend import clock
from backend.appstate import AppSlot
from backend.queueing import app_redis

log = logging.getLogger(__name__)

_PREFIX = "payintent:ephemeral:"
_MEMORY_STORE: AppSlot[MemoryStore] = AppSlot("payintent.ephemeral.memory_store")
# Decrement a live counter above 1 (its TTL stays); one that would fall to 0 is deleted (a window that counts
# nothing holds nothing: refused log-ins with made-up emails must not leave keys behind); a missing (expired)
# key stays missing.
_RELEASE = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v and tonumber(v) > 1 then redis.call('DECR', KEYS[1]) elseif v then redis.call('DEL', KEYS[1]) end "
    "return 0"
)
# RedisStore.incr_pair in one script: count KEYS[1] (its window starts at its first count); unless that passed
# ARGV[2], count KEYS[2] too, but only while it is live (its window started by a plain incr).
_INCR_PAIR = (
    "redis.call('SET', KEYS[1], 0, 'EX', ARGV[1], 'NX') "
    "local first = redis.call('INCR', KEYS[1]) "
    "if first > tonumber(ARGV[2]) or redis.call('EXISTS', KEYS[2]) == 0 then return {first, -1} end "
    "return {first, redis.call('INCR', KEYS[2])}"
)


class EphemeralStore(Protocol):
    def incr(self, key: str, ttl_seconds: int) -> int:
        """Add one to a counter that lives ``ttl_seconds`` from its first increment; return the new value."""
        ...

    def incr_pair(self, key: str, also: str, ttl_seconds: int, limit: int) -> tuple[int, int | None]:
        """``incr(key)`` and, in the same call, one more on ``also`` if it is live and ``key``'s new value is within
        ``limit``: (key's value, also's new value or None when ``also`` was left alone). One round trip for two
        rate limits of a request, the second of which must only start its window once the request is known to
        count (``incr`` does that, the first time)."""
        ...

    def release(self, key: str) -> None:
        """Take one back from a counter (a reservation that did not count); one back at 0 is deleted (its window
        ends: it counted nothing), and an expired one is never revived."""
        ...

    def count(self, key: str) -> tuple[int, int]:
        """(value, seconds until it resets); (0, 0) when absent."""
        ...

    def delete(self, key: str) -> None: ...

    def set_flag(self, key: str, ttl_seconds: int) -> None: ...

    def has_flag(self, key: str) -> bool: ...


class MemoryStore:
    """The in-process fallback: a dict of (value, expires_at) guarded by a lock.

    Times come from ``backend.clock`` so tests can move them.
    """

    MAX_ENTRIES = 100_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[int, float]] = {}

    @staticmethod
    def _now() -> float:
        return clock.now().timestamp()

    def _live(self, key: str, now: float) -> tuple[int, float] | None:
        entry = self._data.get(key)
        if entry is not None and entry[1] <= now:
            del self._data[key]
            return None
        return entry

    def _prune(self, now: float) -> None:
        if len(self._data) < self.MAX_ENTRIES:
            return
        for key in [k for k, (_, expires) in self._data.items() if expires <= now]:
            del self._data[key]
        while len(self._data) >= self.MAX_ENTRIES:  # still full: forget the entries closest to expiry
            del self._data[min(self._data, key=lambda k: self._data[k][1])]

    def incr(self, key: str, ttl_seconds: int) -> int:
        with self._lock:
            now = self._now()
            entry = self._live(key, now)
            if entry is None:
                self._prune(now)
                entry = (0, now + ttl_seconds)
            value = entry[0] + 1
            self._data[key] = (value, entry[1])
            return value

    def incr_pair(self, key: str, also: str, ttl_seconds: int, limit: int) -> tuple[int, int | None]:
        first = self.incr(key, ttl_seconds)
        with self._lock:
            entry = self._live(also, self._now())
            if first > limit or entry is None:
                return first, None
            self._data[also] = (entry[0] + 1, entry[1])
            return first, entry[0] + 1

    def release(self, key: str) -> None:
        with self._lock:
            entry = self._live(key, self._now())
            if entry is not None and entry[0] > 1:
                self._data[key] = (entry[0] - 1, entry[1])
            elif entry is not None:
                del self._data[key]

    def count(self, key: str) -> tuple[int, int]:
        with self._lock:
            now = self._now()
            entry = self._live(key, now)
            if entry is None:
                return 0, 0
            return entry[0], max(1, math.ceil(entry[1] - now))

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def set_flag(self, key: str, ttl_seconds: int) -> None:
        with self._lock:
            now = self._now()
            self._prune(now)
            self._data[key] = (1, now + ttl_seconds)

    def has_flag(self, key: str) -> bool:
        with self._lock:
            return self._live(key, self._now()) is not None


class RedisStore:
    """The shared store: plain keys with a TTL under ``payintent:dashboard:``."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._incr_pair = redis.register_script(_INCR_PAIR)  # EVALSHA: the script is sent once per server

    def incr(self, key: str, ttl_seconds: int) -> int:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(_PREFIX + key, 0, ex=ttl_seconds, nx=True)  # starts the window; INCR keeps the TTL
        pipe.incr(_PREFIX + key)
        return int(pipe.execute()[1])

    def incr_pair(self, key: str, also: str, ttl_seconds: int, limit: int) -> tuple[int, int | None]:
        first, second = self._incr_pair(keys=[_PREFIX + key, _PREFIX + also], args=[ttl_seconds, limit])
        return int(first), (None if int(second) < 0 else int(second))

    def release(self, key: str) -> None:
        self._redis.eval(_RELEASE, 1, _PREFIX + key)  # one script: atomic, and DECR alone would revive an expired key

    def count(self, key: str) -> tuple[int, int]:
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(_PREFIX + key)
        pipe.ttl(_PREFIX + key)
        value, ttl = pipe.execute()
        if value is None:
            return 0, 0
        return int(value), max(1, int(ttl))

    def delete(self, key: str) -> None:
        self._redis.delete(_PREFIX + key)

    def set_flag(self, key: str, ttl_seconds: int) -> None:
        self._redis.set(_PREFIX + key, 1, ex=ttl_seconds)

    def has_flag(self, key: str) -> bool:
        return bool(self._redis.exists(_PREFIX + key))


T = TypeVar("T")


def memory_store() -> MemoryStore:
    """The current app's in-process store (one per app, so tests never share one)."""
    return _MEMORY_STORE.get_or_make(MemoryStore)


class _FallbackStore:
    """Redis when configured, the in-process store when not or when Redis fails."""

    def __init__(self, redis: Redis | None) -> None:
        self._primary = RedisStore(redis) if redis is not None else None

    def _call(self, operation: Callable[[EphemeralStore], T]) -> T:
        if self._primary is not None:
            try:
                return operation(self._primary)
            except RedisError as exc:
                log.warning("ephemeral store: Redis failed (%s); using the in-process store", type(exc).__name__)
        return operation(memory_store())

    def incr(self, key: str, ttl_seconds: int) -> int:
        return self._call(lambda store: store.incr(key, ttl_seconds))

    def incr_pair(self, key: str, also: str, ttl_seconds: int, limit: int) -> tuple[int, int | None]:
        return self._call(lambda store: store.incr_pair(key, also, ttl_seconds, limit))

    def release(self, key: str) -> None:
        self._call(lambda store: store.release(key))

    def count(self, key: str) -> tuple[int, int]:
        return self._call(lambda store: store.count(key))

    def delete(self, key: str) -> None:
        self._call(lambda store: store.delete(key))

    def set_flag(self, key: str, ttl_seconds: int) -> None:
        self._call(lambda store: store.set_flag(key, ttl_seconds))

    def has_flag(self, key: str) -> bool:
        return bool(self._call(lambda store: store.has_flag(key)))


def store() -> EphemeralStore:
    return _FallbackStore(app_redis(fast=True))
