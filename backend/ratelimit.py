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
from backend.ephemeral import store
from backend.errors import DomainError

log = logging.getLogger(__name__)
IPV6_CLIENT_PREFIX = 64
_warned_about_forwarded_for = False


def client_key(address: str | None = None) -> str:
    """The client a per-IP limit counts: an IPv4 address as is (an IPv4-mapped IPv6 one too), an IPv6
    address as its /64 network, anything else as given. ``address``: the request's ``remote_addr``."""
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
        return str(ipaddress.IPv6Network((unscoped, IPV6_CLIENT_PREFIX), strict=False))
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
    _, resets_in = counters.count(name)
    return max(1, resets_in)


def enforce(key: str, per_minute: int) -> None:
    """Count one request for ``key``; 429 RATE_LIMITED with Retry-After past ``per_minute`` (0: no limit)."""
    if per_minute <= 0:
        return
    retry_after = hit(key, per_minute, 60)
    if retry_after is not None:
        raise DomainError(
            "RATE_LIMITED", "Too many requests; try again shortly", headers={"Retry-After": str(retry_after)}
        )
