"""Rate limits: the one place requests are counted per client (API keys, client IPs, the public
checkout API, dashboard sign-ups) and the one place an API 429 is answered (the dashboard's login throttle,
which reserves attempts before checking passwords, is in ``backend.dashboard.security``).

A fixed window that starts at the first request; counts live in ``backend.ephemeral`` (Redis when
configured and shared by every API process, else per process). Limits of 0 are off.

A client is its IPv4 address, or the /64 network of its IPv6 address (:func:`client_key`): one IPv6
host usually holds a whole /64 and could take a fresh address for every request.
"""

from __future__ import annotations

import ipaddress
import logging

from flask import request

from backend import appstate
from backend.ephemeral import EphemeralStore, store
from backend.errors import DomainError

log = logging.getLogger(__name__)
IPV6_CLIENT_PREFIX = 64
_warned_about_forwarded_for = False


def client_key(address: str | None = None, ipv6_prefix: int = IPV6_CLIENT_PREFIX) -> str:
    """The client a per-IP limit counts: an IPv4 address as is (an IPv4-mapped IPv6 one too), an IPv6
    address as its network of ``ipv6_prefix`` bits (a /64: one subscriber's LAN; a /48, for what an anonymous
    client can do that writes: one site), anything else as given. ``address``: the request's ``remote_addr``."""
    if address is None:
        address = request.remote_addr
        _warn_if_proxied_unconfigured()
    if not address:
        return "unknown"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # a unix socket, or no address at all
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        unscoped = ipaddress.IPv6Address(int(ip))  # fe80::1%eth0: the zone is not part of the network
        return str(ipaddress.IPv6Network((unscoped, ipv6_prefix), strict=False))
    return str(ip)


def _warn_if_proxied_unconfigured() -> None:
    """Once per process: a request with X-Forwarded-For while TRUSTED_PROXY_HOPS is 0. Behind a proxy, that
    setting makes every client one: the proxy's address, one rate-limit bucket for all."""
    global _warned_about_forwarded_for
    if _warned_about_forwarded_for or "X-Forwarded-For" not in request.headers:
        return
    if appstate.settings().trusted_proxy_hops == 0:
        _warned_about_forwarded_for = True
        log.warning(
            "a request came through a proxy (X-Forwarded-For) but TRUSTED_PROXY_HOPS is 0: rate limits count "
            "every client behind it as one (the proxy's address). Set TRUSTED_PROXY_HOPS to the number of "
            "proxies in front of the api (docs/deploy.md); logged once per process"
        )


def hit(key: str, limit: int, window_seconds: int) -> int | None:
    """Count one request for ``key``; None if allowed, else the seconds until the window resets."""
    counters = store()
    name = f"rl:{key}"
    if counters.incr(name, window_seconds) <= limit:
        return None
    return _resets_in(counters, name)


def _resets_in(counters: EphemeralStore, name: str) -> int:
    _, resets_in = counters.count(name)
    return max(1, resets_in)


def _limited(retry_after: int) -> DomainError:
    return DomainError(
        "RATE_LIMITED", "Too many requests; try again shortly", headers={"Retry-After": str(retry_after)}
    )


def enforce(key: str, per_minute: int) -> None:
    """Count one request for ``key``; 429 RATE_LIMITED with Retry-After past ``per_minute`` (0: no limit)."""
    if per_minute <= 0:
        return
    retry_after = hit(key, per_minute, 60)
    if retry_after is not None:
        raise _limited(retry_after)


def enforce_and_count_ahead(key: str, per_minute: int, then: str, then_per_minute: int) -> int | None:
    """:func:`enforce` ``key`` and, in the same round trip, count the request for ``then`` too if ``then``'s window
    is open (a request already counted there in it) and ``key`` allowed it: ``then``'s new count, for
    :func:`enforce_counted` once the request is known to count there (the API key's limit, after the key is
    checked); None when ``then`` was left alone. A request pays one round trip for both limits, except the first
    for ``then`` in each window; a made-up key never opens a window."""
    if per_minute <= 0 or then_per_minute <= 0:
        enforce(key, per_minute)
        return None
    counters = store()
    name = f"rl:{key}"
    count, then_count = counters.incr_pair(name, f"rl:{then}", 60, per_minute)
    if count > per_minute:
        raise _limited(_resets_in(counters, name))
    return then_count


def enforce_counted(then: str, then_per_minute: int, counted: int | None) -> None:
    """The limit on ``then`` for a request :func:`enforce_and_count_ahead` counted there (``counted``) or not (None:
    counted now)."""
    if counted is None:
        enforce(then, then_per_minute)
    elif counted > then_per_minute:
        raise _limited(_resets_in(store(), f"rl:{then}"))
