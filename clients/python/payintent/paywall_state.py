"""The paywall's memory, all of it bounded: the shared intents, what it sold, and its request budget.

- :class:`Bounded`: a thread-safe map holding at most ``size`` entries (least recently used go first).
- :class:`SharedIntents`: the pending intent each (route, price) shows in its 402s, made once and
  reused; and the intents this paywall issued (a payment may name only those without an API call).
- :class:`Budget`: token buckets in front of the API calls made on a request's behalf, one per client
  (IPv6 by /64) and one for the whole paywall, so that nobody spends the merchant's API quota for it.
"""

from __future__ import annotations

import ipaddress
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Generic, TypeVar

from payintent.client import PayIntentClient, PayIntentError
from payintent.paywall_request import PaidRequest

__all__ = ["Bounded", "Budget", "Issued", "SharedIntents", "client_key"]

K = TypeVar("K")
V = TypeVar("V")

RESOURCE_KEY = "paywall_resource"  # intent metadata: the route's digest (audience, method, route)
PATH_KEY = "paywall_path"  # intent metadata: the route, for people reading the dashboard
MAX_ROUTES = 1024  # shared intents held (one per route and price in use)
MAX_ISSUED = 8192  # intents this paywall issued and still recognises in a payment
LOCK_STRIPES = 64


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


def parse_timestamp(text: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Issued:
    """An intent this paywall showed in a 402: for which route and price, with which requirements."""

    route_key: str
    price: Decimal
    requirements: tuple[Mapping[str, Any], ...]


class SharedIntents:
    """The pending intent each (route, price) shows in its 402s, created once and reused."""

    def __init__(self, client: PayIntentClient, clock: Callable[[], float], margin: float, recheck: float) -> None:
        self.client = client
        self.clock = clock
        self.margin = margin
        self.recheck = recheck
        self._stripes = tuple(threading.Lock() for _ in range(LOCK_STRIPES))  # concurrent 402s make one intent
        self._intents: Bounded[tuple[str, Decimal], tuple[dict[str, Any], float]] = Bounded(MAX_ROUTES)
        self.issued: Bounded[str, Issued] = Bounded(MAX_ISSUED)

    def current(self, request: PaidRequest) -> dict[str, Any]:
        slot = (request.route_key, request.price)
        with self._stripes[zlib.crc32(request.route_key.encode()) % LOCK_STRIPES]:
            cached = self._intents.get(slot)
            now = self.clock()
            if cached is not None and self._usable(cached[0], now):
                intent, read_at = cached
                if now - read_at < self.recheck:
                    return intent
                try:
                    fresh = self.client.get_intent(str(intent["intent_id"]))
                except PayIntentError as err:
                    if not (err.transient or err.status == 429):
                        raise
                    return intent  # the API is busy or the key's quota used up: show the intent we have
                if fresh.get("status") == "pending":
                    self._intents.put(slot, (fresh, now))
                    return fresh
            intent = self.client.create_intent(
                request.price,
                description=request.description[:500],
                metadata={RESOURCE_KEY: request.route_key, PATH_KEY: request.route[:500]},
            )
            self._intents.put(slot, (intent, now))
            requirements = tuple(dict(r) for r in intent.get("payment_requirements") or ())
            self.issued.put(str(intent["intent_id"]), Issued(request.route_key, request.price, requirements))
            return intent

    def shown(self, request: PaidRequest) -> dict[str, Any] | None:
        """The intent this route shows now, if it has one (no API call)."""
        cached = self._intents.get((request.route_key, request.price))
        return cached[0] if cached is not None else None

    def known(self, intent_id: str, request: PaidRequest) -> Issued | None:
        """What this paywall issued ``intent_id`` for, if it issued it for this route at this price."""
        issued = self.issued.get(intent_id)
        if issued is None or issued.route_key != request.route_key or issued.price != request.price:
            return None
        return issued

    def _usable(self, intent: Mapping[str, Any], now: float) -> bool:
        expires = parse_timestamp(intent.get("expires_at"))
        return intent.get("status") == "pending" and expires is not None and expires - now > self.margin

    def drop(self, request: PaidRequest, intent_id: str) -> None:
        """Stop showing ``intent_id`` (paid, being settled or closed); the next 402 gets a new one."""
        slot = (request.route_key, request.price)
        cached = self._intents.get(slot)
        if cached is not None and str(cached[0]["intent_id"]) == intent_id:
            self._intents.pop(slot, cached)


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
