"""Sending one webhook request: target checks on the resolved address, a hard deadline, no redirects.

The host is resolved here, every resolved address is checked (loopback, private, link-local,
metadata and other non-global addresses are refused unless WEBHOOK_ALLOW_PRIVATE_TARGETS is set),
and the connection goes to the checked address itself, so DNS cannot change the answer between
check and connect (rebinding). HTTPS still verifies the certificate against the URL's host name.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import urlsplit

import urllib3
from urllib3.exceptions import HTTPError as Urllib3Error

DEADLINE_SECONDS = 10.0
RESPONSE_EXCERPT_BYTES = 1024
_DRAIN_LIMIT = 64 * 1024
_POOL_CACHE_SIZE = 256
USER_AGENT = "payintent-webhooks/1"


class TargetRefused(ValueError):
    """The URL may not be delivered to (scheme, host, or a refused address)."""


@dataclass(frozen=True)
class SendResult:
    succeeded: bool
    status_code: int | None
    latency_ms: int
    error: str | None
    response_body: str | None


def address_allowed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Only globally routable unicast addresses (no loopback, private, link-local, CGNAT, metadata...)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def check_url_literal(url: str, allow_private: bool) -> None:
    """Registration-time check: refuse URLs that name a refused address literally (or localhost).

    Host names are checked again, resolved, at every delivery.
    """
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise TargetRefused("the URL must be http:// or https:// with a host")
    if parts.username or parts.password:
        raise TargetRefused("the URL must not carry credentials")
    if allow_private:
        return
    host = parts.hostname
    if host == "localhost" or host.endswith(".localhost"):
        raise TargetRefused("loopback targets are not allowed")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return
    if not address_allowed(ip):
        raise TargetRefused(f"{ip} is not a public address")


def resolve(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to; every address the name resolves to must be allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TargetRefused(f"cannot resolve {host}: {exc}") from None
    addresses = [info[4][0] for info in infos]
    if not addresses:
        raise TargetRefused(f"{host} resolves to no address")
    if not allow_private:
        for address in addresses:
            if not address_allowed(ipaddress.ip_address(address.split("%", 1)[0])):
                raise TargetRefused(f"{host} resolves to {address}, which is not a public address")
    return addresses[0]


class _Pools:
    """Keep-alive connection pools per (scheme, address, port, host name), least recently used first out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: OrderedDict[tuple[str, str, int, str], urllib3.HTTPConnectionPool] = OrderedDict()

    def get(self, scheme: str, address: str, port: int, host: str) -> urllib3.HTTPConnectionPool:
        key = (scheme, address, port, host)
        with self._lock:
            pool = self._pools.get(key)
            if pool is not None:
                self._pools.move_to_end(key)
                return pool
            if scheme == "https":
                pool = urllib3.HTTPSConnectionPool(
                    address, port, maxsize=32, retries=False, server_hostname=host, assert_hostname=host
                )
            else:
                pool = urllib3.HTTPConnectionPool(address, port, maxsize=32, retries=False)
            self._pools[key] = pool
            while len(self._pools) > _POOL_CACHE_SIZE:
                _, old = self._pools.popitem(last=False)
                old.close()
            return pool


_pools = _Pools()


def _excerpt(data: bytes) -> str | None:
    return data[:RESPONSE_EXCERPT_BYTES].decode("utf-8", "replace") if data else None


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    allow_private: bool,
    deadline: float = DEADLINE_SECONDS,
) -> SendResult:
    """POST ``body`` to ``url``; success is a 2xx status received within ``deadline`` seconds."""
    started = time.monotonic()

    def result(ok: bool, status: int | None, error: str | None, excerpt: str | None = None) -> SendResult:
        return SendResult(ok, status, int((time.monotonic() - started) * 1000), error, excerpt)

    parts = urlsplit(url)
    try:
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise TargetRefused("the URL must be http:// or https:// with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = resolve(parts.hostname, port, allow_private)
    except (TargetRefused, ValueError) as exc:
        return result(False, None, f"refused: {exc}")
    host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    if ":" in parts.hostname and parts.port is None:
        host_header = f"[{parts.hostname}]"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    request_headers = {
        "Host": host_header,
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        **headers,
    }
    pool = _pools.get(parts.scheme, address, port, parts.hostname)
    remaining = max(deadline - (time.monotonic() - started), 0.001)
    try:
        response = pool.urlopen(
            "POST",
            path,
            body=body,
            headers=request_headers,
            redirect=False,
            retries=False,
            preload_content=False,
            timeout=urllib3.Timeout(connect=remaining, read=remaining),
            assert_same_host=False,
        )
    except urllib3.exceptions.NewConnectionError as exc:  # refused, unreachable (a ConnectTimeoutError subclass)
        return result(False, None, f"connection failed: {_short(exc.__cause__ or exc)}")
    except (TimeoutError, urllib3.exceptions.TimeoutError):
        return result(False, None, f"timeout: no response within {deadline:g} s")
    except (Urllib3Error, OSError) as exc:
        return result(False, None, f"connection failed: {type(exc).__name__}: {_short(exc)}")
    status = response.status
    in_time = (time.monotonic() - started) <= deadline
    excerpt = None
    try:
        excerpt = _excerpt(response.read(RESPONSE_EXCERPT_BYTES))
        if len(response.read(_DRAIN_LIMIT)) < _DRAIN_LIMIT:
            response.release_conn()  # body fully read: the connection can be reused
        else:
            response.close()
    except (Urllib3Error, OSError):
        response.close()
    if not in_time:
        return result(False, status, f"timeout: answered after more than {deadline:g} s", excerpt)
    if 200 <= status < 300:
        return result(True, status, None, excerpt)
    if 300 <= status < 400:
        return result(False, status, f"redirect ({status}) not followed", excerpt)
    return result(False, status, f"HTTP {status}", excerpt)


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else ""
