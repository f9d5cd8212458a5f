"""The paywall's memory, all of it bounded: the merchant's catalog, the tokens it issued, and its request budget.

- :class:`Bounded`: a thread-safe map holding at most ``size`` entries (least recently used go first).
- :class:`Catalog`: the merchant's networks, wallets and tokens, read from the facilitator's ``/supported``
  once a few minutes: what a 402's requirements are built from.
- :class:`Budget`: token buckets in front of the API calls made on a request's behalf, one per client
  (IPv6 by /64) and one for the whole paywall, so that nobody spends the merchant's API quota for it.
"""

from __future__ import annotations

import ipaddress
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from payintent.client import PayIntentClient, PayIntentError
from payintent.paywall_request import PaidRequest

__all__ = ["Bounded", "Budget", "Catalog", "client_key"]

K = TypeVar("K")
V = TypeVar("V")

RETRY_SECONDS = 30.0  # after a failed read of the catalog, the next try
ATOMIC_PER_USDC = 1_000_000  # USDC has 6 decimals on every network the facilitator settles


class Bounded(Generic[K, V]):
    """A map of at most ``size`` entries; the least recently used entry is dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            self._trim()

    def put_new(self, key: K, value: V) -> V:
        """Store ``value`` unless ``key`` holds one already; returns what ``key`` holds afterwards."""
        with self._lock:
            held = self._items.get(key)
            if held is not None:
                return held
            self._items[key] = value
            self._trim()
            return value

    def pop(self, key: K, only: V | None = None) -> None:
        """Forget ``key`` (only if it holds ``only``, when given)."""
        with self._lock:
            if key in self._items and (only is None or self._items[key] == only):
                del self._items[key]

    def __len__(self) -> int:
        return len(self._items)

    def _trim(self) -> None:
        while len(self._items) > self.size:
            self._items.popitem(last=False)


class Catalog:
    """What this merchant is paid with (``GET /x402/facilitator/supported``), read once and every ``ttl`` seconds:
    a 402 is built from it without an API call, and no intent or row exists for a request nobody paid.

    Only EVM networks (the facilitator's kinds): a Solana transaction carries the intent it pays in its memo,
    which a paywall that makes no intent per 402 cannot name. When a refresh fails, the last catalog is used
    (stale by at most ``stale`` seconds); with none, the error is raised (the paywall answers 503)."""

    def __init__(self, client: PayIntentClient, clock: Callable[[], float], ttl: float, stale: float) -> None:
        self.client = client
        self.clock = clock
        self.ttl = ttl
        self.stale = stale
        self._lock = threading.Lock()
        self._templates: dict[str, dict[str, Any]] = {}  # CAIP-2 network -> the requirement's fixed fields
        self._read_at: float | None = None
        self._retry_at = 0.0

    def requirements(self, request: PaidRequest) -> list[dict[str, Any]]:
        """One ``exact`` requirement per network for ``request`` (its price, URL and description)."""
        atomic = request.price * ATOMIC_PER_USDC
        if atomic <= 0 or atomic != atomic.to_integral_value():
            raise ValueError(f"a price must be above 0 USDC with at most 6 decimals, not {request.price}")
        amount = str(int(atomic))
        return [
            {
                **template,  # first: the catalog never overrides the price, the network or the resource
                "scheme": "exact",
                "network": network,
                "maxAmountRequired": amount,
                "resource": request.url,
                "description": request.description[:500],
                "mimeType": "application/json",
            }
            for network, template in self._current().items()
        ]

    def _current(self) -> dict[str, dict[str, Any]]:
        with self._lock:  # one refresh at a time: concurrent 402s make one API call
            now = self.clock()
            if self._read_at is not None and now - self._read_at < self.ttl:
                return self._templates
            if now < self._retry_at:  # a read failed moments ago: not again for every request
                if self._read_at is not None and now - self._read_at < self.ttl + self.stale:
                    return self._templates
                raise PayIntentError(None, "NETWORK_ERROR", "the merchant's catalog cannot be read now")
            try:
                supported = self.client.facilitator_supported()
            except PayIntentError:
                self._retry_at = now + RETRY_SECONDS
                if self._read_at is not None and now - self._read_at < self.ttl + self.stale:
                    return self._templates
                raise
            templates: dict[str, dict[str, Any]] = {}
            for kind in supported.get("kinds") or ():
                extra = kind.get("extra") if isinstance(kind, Mapping) else None
                network = kind.get("network") if isinstance(kind, Mapping) else None
                if not isinstance(extra, Mapping) or not isinstance(network, str) or kind.get("x402Version") != 2:
                    continue
                fields_ok = all(isinstance(extra.get(k), str) for k in ("payTo", "asset"))
                if (
                    fields_ok
                    and isinstance(extra.get("maxTimeoutSeconds"), int)
                    and isinstance(extra.get("extra"), dict)
                ):
                    templates[network] = dict(extra)
            if not templates:
                raise PayIntentError(
                    None, "NO_NETWORK", "the merchant has no wallet on a network the facilitator settles"
                )
            self._templates, self._read_at = templates, now
            return templates


def client_key(address: str | None) -> str:
    """Whom a budget is kept for: the client's IP address, an IPv6 one by its /64 (one site's block)."""
    try:
        ip = ipaddress.ip_address(str(address or "").strip())
    except ValueError:
        return str(address or "")[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _Bucket:
    def __init__(self, per_minute: int, now: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, per_minute / 4.0)  # a burst of a quarter minute's worth
        self.tokens = self.capacity
        self.at = now

    def wait(self, now: float) -> float:
        """Seconds until one token is there (0: there is one now)."""
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate


class Budget:
    """How many requests a minute may make API calls: ``per_client`` each, ``total`` together (0: no limit)."""

    MAX_CLIENTS = 10_000

    def __init__(self, per_client: int, total: int, clock: Callable[[], float]) -> None:
        self.per_client = per_client
        self.total = total
        self.clock = clock
        self._lock = threading.Lock()
        self._clients: Bounded[str, _Bucket] = Bounded(self.MAX_CLIENTS)
        self._all = _Bucket(total, clock()) if total > 0 else None

    def take(self, client: str) -> tuple[int, float] | None:
        """Spend one request's allowance; None when granted, else (status, seconds to wait): 429 for this
        client's share, 503 for the paywall's."""
        now = self.clock()
        with self._lock:
            mine = None
            if self.per_client > 0:
                mine = self._clients.get(client)
                if mine is None:
                    mine = _Bucket(self.per_client, now)
                    self._clients.put(client, mine)
                wait = mine.wait(now)
                if wait > 0:
                    return 429, wait
            if self._all is not None:
                wait = self._all.wait(now)
                if wait > 0:
                    return 503, wait
                self._all.tokens -= 1
            if mine is not None:
                mine.tokens -= 1
        return None
