"""Sending one webhook request: target checks on the resolved address, a hard deadline, no redirects.

The host is resolved here, every resolved address is checked (loopback, private, link-local,
metadata and every other non-public range, including IPv6 forms that embed such an IPv4
address, are refused unless WEBHOOK_ALLOW_PRIVATE_TARGETS is set), and the connection goes to
the checked address itself, so DNS cannot change the answer between check and connect
(rebinding). HTTPS verifies the certificate against the URL's host name.

Name resolution has its own, shorter bound (WEBHOOK_DNS_TIMEOUT_SECONDS) inside the deadline, and a
name server that never answers cannot exhaust resolution for everyone: ``getaddrinfo`` cannot be
cancelled, so each lookup runs in its own daemon thread that an attempt stops waiting for (no pool
slot is held for others); lookups of one name are shared (one thread per name at a time); a name
that failed or did not answer fails at once for a short while (negative cache); and the threads
left running are capped per owner (the merchant) and for the process.

The deadline is wall-clock for the whole attempt: name resolution, connect, TLS, request and
response. A watchdog shuts the socket down when it passes, so a receiver that trickles bytes
cannot hold a sender longer than the deadline. Connections are kept alive per checked address
(a stale one is replaced by a fresh one within the same attempt).
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

DEADLINE_SECONDS = 10.0
# Name resolution's share of the deadline: a name not resolved within it fails the attempt (retried later).
DNS_TIMEOUT_SECONDS = 5.0
# A name whose lookup failed or did not answer fails at once for this long (shorter than the first retry).
NEGATIVE_TTL_SECONDS = 30.0
# Lookup threads alive at once (answered or abandoned), for one owner's names and for the process.
MAX_UNANSWERED_LOOKUPS_PER_OWNER = 4
MAX_LOOKUPS = 256
RESPONSE_EXCERPT_BYTES = 1024
_DRAIN_LIMIT = 64 * 1024
USER_AGENT = "payintent-webhooks/1"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Refused whatever Python's is_global says in a given release (it has changed between patch releases).
_DENIED = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
        "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
        "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
        "::/96", "::ffff:0:0:0/96",  # unspecified, loopback, IPv4-compatible, IPv4-translated
        "64:ff9b:1::/48", "100::/64", "2001::/23", "2001:db8::/32", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
    )
)  # fmt: skip
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class TargetRefused(ValueError):
    """The URL may not be delivered to (scheme, host, port, or a refused address)."""


@dataclass(frozen=True)
class SendResult:
    succeeded: bool
    status_code: int | None
    latency_ms: int
    error: str | None
    response_body: str | None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_allowed(ip: IPAddress) -> bool:
    """Only public unicast addresses; IPv6 forms carrying an IPv4 address are judged by that address."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return address_allowed(embedded)
    if any(ip.version == net.version and ip in net for net in _DENIED):
        return False
    return ip.is_global and not ip.is_multicast


def _host_and_port(parts: SplitResult) -> tuple[str, int]:
    """The URL's host as ASCII (IDNA) and its port; TargetRefused when either is unusable."""
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise TargetRefused("the URL must be http:// or https:// with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise TargetRefused("the URL's port is not a valid port number") from None
    try:
        host = parts.hostname.encode("idna").decode("ascii") if not parts.hostname.isascii() else parts.hostname
    except UnicodeError:
        raise TargetRefused("the URL's host is not a valid host name") from None
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in host) or len(host) > 253:
        raise TargetRefused("the URL's host is not a valid host name")
    return host, port


def check_url_literal(url: str, allow_private: bool) -> None:
    """Registration-time check: the URL is usable, and names no refused address literally (or localhost).

    Host names are checked again, resolved, at every delivery.
    """
    parts = urlsplit(url)
    host, _ = _host_and_port(parts)
    if parts.username or parts.password:
        raise TargetRefused("the URL must not carry credentials")
    if allow_private:
        return
    if host == "localhost" or host.endswith(".localhost"):
        raise TargetRefused("loopback targets are not allowed")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return
    if not address_allowed(ip):
        raise TargetRefused(f"{ip} is not a public address")


def _system_lookup(host: str) -> list[str]:
    """Every address the system resolver gives for ``host`` (blocking; cannot be cancelled)."""
    return [str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]


class _Lookup:
    __slots__ = ("addresses", "done", "error", "owner")

    def __init__(self, owner: str | None) -> None:
        self.owner = owner
        self.done = threading.Event()
        self.addresses: list[str] = []
        self.error: str | None = None


class _Resolver:
    """Lookups in their own daemon threads, shared per name, with a negative cache and thread caps."""

    def __init__(self, lookup: Callable[[str], list[str]] = _system_lookup) -> None:
        self.lookup = lookup
        self._lock = threading.Lock()
        self._running: dict[str, _Lookup] = {}
        self._per_owner: dict[str, int] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # name -> (until, why), monotonic time

    def resolve(self, host: str, timeout: float, owner: str | None) -> list[str]:
        with self._lock:
            failed = self._failed.get(host)
            if failed is not None:
                if failed[0] > time.monotonic():
                    raise TargetRefused(f"{failed[1]} (not asked again for {NEGATIVE_TTL_SECONDS:g} s)")
                del self._failed[host]
            job = self._running.get(host)
            if job is None:
                job = self._start(host, owner)
        if not job.done.wait(max(timeout, 0.001)):
            with self._lock:
                late = job.done.is_set()  # it may have answered since: then use the answer
                if not late:
                    self._remember_failure(host, "the host's name servers did not answer")
            if not late:
                raise TargetRefused(f"resolving the host took longer than {timeout:.2g} s: no answer")
        if job.error is not None:
            raise TargetRefused(f"cannot resolve the host: {job.error}")
        return job.addresses

    def _start(self, host: str, owner: str | None) -> _Lookup:
        """A new lookup thread for ``host`` (the lock is held)."""
        if len(self._running) >= MAX_LOOKUPS:
            raise TargetRefused("too many unanswered DNS lookups in this worker; try again later")
        if owner is not None and self._per_owner.get(owner, 0) >= MAX_UNANSWERED_LOOKUPS_PER_OWNER:
            raise TargetRefused("too many of this merchant's webhook hosts have unanswered DNS lookups")
        job = _Lookup(owner)
        self._running[host] = job
        if owner is not None:
            self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        threading.Thread(target=self._run, args=(host, job), name="webhook-dns", daemon=True).start()
        return job

    def _run(self, host: str, job: _Lookup) -> None:
        try:
            job.addresses = self.lookup(host)
        except (OSError, UnicodeError) as exc:
            job.error = str(exc) or type(exc).__name__
        except Exception as exc:  # an odd resolver failure is the attempt's failure, never a stuck waiter
            job.error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            del self._running[host]
            if job.owner is not None:
                left = self._per_owner[job.owner] - 1
                if left:
                    self._per_owner[job.owner] = left
                else:
                    del self._per_owner[job.owner]
            if job.error is None:
                self._failed.pop(host, None)  # it answered after all (late): ask again next time
            else:
                self._remember_failure(host, f"cannot resolve the host: {job.error}")
            job.done.set()

    def _remember_failure(self, host: str, why: str) -> None:
        """Fail ``host`` at once for NEGATIVE_TTL_SECONDS (the lock is held)."""
        now = time.monotonic()
        if len(self._failed) >= 10_000:  # bounded: drop what has run out, else forget the lot
            for name in [n for n, (until, _) in self._failed.items() if until <= now]:
                del self._failed[name]
            if len(self._failed) >= 10_000:
                self._failed.clear()
        self._failed[host] = (now + NEGATIVE_TTL_SECONDS, why)


_resolver = _Resolver()


def resolve(
    host: str, port: int, allow_private: bool, timeout: float = DNS_TIMEOUT_SECONDS, owner: str | None = None
) -> str:
    """The address to connect to; every address the name resolves to must be allowed.

    ``owner`` (the merchant) is who the lookup is for: it bounds how many of one owner's lookups may
    be left running unanswered. ``port`` is the URL's (name resolution does not depend on it).
    """
    try:
        addresses = [str(ipaddress.ip_address(host))]  # a literal address: nothing to look up
    except ValueError:
        addresses = _resolver.resolve(host, timeout, owner)
    if not addresses:
        raise TargetRefused("the host resolves to no address")
    if not allow_private:
        for address in addresses:
            if not address_allowed(ipaddress.ip_address(address.split("%", 1)[0])):
                raise TargetRefused(f"the host resolves to {address}, which is not a public address")
    return addresses[0]


_tls_context: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    """One verifying TLS context for the process (building one costs ~20 ms of CPU)."""
    global _tls_context
    if _tls_context is None:
        _tls_context = ssl.create_default_context()
    return _tls_context


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a checked address, with SNI and certificate checks for the URL's host name."""

    def __init__(self, address: str, port: int, server_hostname: str, timeout: float) -> None:
        super().__init__(address, port, timeout=timeout, context=_tls())
        self._server_hostname = server_hostname

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = _tls().wrap_socket(self.sock, server_hostname=self._server_hostname)  # the context given above


class _Alarm:
    __slots__ = ("cancelled", "conn", "fired")

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn
        self.fired = False
        self.cancelled = False


_RECHECK_SECONDS = 0.05


class _Watchdog:
    """One thread for the process that shuts a connection's socket down when its deadline passes,
    unblocking any read or write on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Alarm]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None

    def arm(self, conn: http.client.HTTPConnection, seconds: float) -> _Alarm:
        alarm = _Alarm(conn)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="webhook-deadlines", daemon=True)
                self._thread.start()
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + seconds, self._seq, alarm))
            self._cond.notify()
        return alarm

    @staticmethod
    def disarm(alarm: _Alarm) -> None:
        alarm.cancelled = True  # the entry is dropped when it reaches the top

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                when, _, alarm = self._heap[0]
                if alarm.cancelled:
                    heapq.heappop(self._heap)
                    continue
                delay = when - time.monotonic()
                if delay > 0:
                    self._cond.wait(timeout=delay)
                    continue
                heapq.heappop(self._heap)
                alarm.fired = True
                sock = alarm.conn.sock
                if sock is None:
                    # Still connecting: shut the socket as soon as it exists, or a TLS handshake or an
                    # answer trickled after a late connect would only meet per-read timeouts.
                    self._seq += 1
                    heapq.heappush(self._heap, (time.monotonic() + _RECHECK_SECONDS, self._seq, alarm))
                    continue
            if not alarm.cancelled:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


_watchdog = _Watchdog()
_IDLE_SECONDS = 15.0
_IDLE_PER_TARGET = 8


class _IdleConnections:
    """Kept-alive connections per (scheme, checked address, port, host name); stale ones are dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int, str], list[tuple[float, http.client.HTTPConnection]]] = {}

    def take(self, key: tuple[str, str, int, str]) -> http.client.HTTPConnection | None:
        now = time.monotonic()
        with self._lock:
            stack = self._idle.get(key, [])
            while stack:
                since, conn = stack.pop()
                if now - since < _IDLE_SECONDS:
                    return conn
                conn.close()
        return None

    def give(self, key: tuple[str, str, int, str], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            stack = self._idle.setdefault(key, [])
            if len(stack) < _IDLE_PER_TARGET and len(self._idle) <= 1024:
                stack.append((time.monotonic(), conn))
                return
        conn.close()


_idle = _IdleConnections()
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


def _excerpt(data: bytes) -> str | None:
    return data[:RESPONSE_EXCERPT_BYTES].decode("utf-8", "replace") if data else None


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    allow_private: bool,
    deadline: float = DEADLINE_SECONDS,
    dns_timeout: float = DNS_TIMEOUT_SECONDS,
    owner: str | None = None,
) -> SendResult:
    """POST ``body`` to ``url``; success is a 2xx status received within ``deadline`` seconds.

    Resolving the host may take at most ``dns_timeout`` of it; ``owner`` is the merchant it is for.
    """
    started = time.monotonic()

    def remaining() -> float:
        return deadline - (time.monotonic() - started)

    def result(ok: bool, status: int | None, error: str | None, excerpt: str | None = None) -> SendResult:
        return SendResult(ok, status, int((time.monotonic() - started) * 1000), error, excerpt)

    parts = urlsplit(url)
    try:
        host, port = _host_and_port(parts)
        address = resolve(host, port, allow_private, timeout=min(dns_timeout, remaining()), owner=owner)
    except TargetRefused as exc:
        return result(False, None, f"refused: {exc}")
    default_port = port == (443 if parts.scheme == "https" else 80)
    host_header = f"[{host}]" if ":" in host else host
    if not default_port:
        host_header = f"{host_header}:{port}"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    key = (parts.scheme, address, port, host)
    request_headers = {
        "Host": host_header,
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "User-Agent": USER_AGENT,
        **headers,
    }
    reused = _idle.take(key)
    if reused is not None:
        outcome = _exchange(reused, key, path, request_headers, body, remaining, deadline, reused=True)
        if outcome is not None:
            return result(*outcome)
        # The receiver had closed that idle connection before reading anything: use a fresh one.
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = _PinnedHTTPSConnection(address, port, host, max(remaining(), 0.001))
    else:
        conn = http.client.HTTPConnection(address, port, timeout=max(remaining(), 0.001))
    outcome = _exchange(conn, key, path, request_headers, body, remaining, deadline, reused=False)
    assert outcome is not None
    return result(*outcome)


Outcome = tuple[bool, int | None, str | None, str | None]  # succeeded, status, error, response excerpt


def _exchange(
    conn: http.client.HTTPConnection,
    key: tuple[str, str, int, str],
    path: str,
    headers: dict[str, str],
    body: bytes,
    remaining: Callable[[], float],
    deadline: float,
    *,
    reused: bool,
) -> Outcome | None:
    """One request on ``conn`` under the deadline watchdog; None if a reused connection was stale."""
    if conn.sock is not None:
        conn.sock.settimeout(max(remaining(), 0.001))
    alarm = _watchdog.arm(conn, max(remaining(), 0.001))
    status: int | None = None
    keep = False
    try:
        conn.putrequest("POST", path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        status = response.status
        in_time = remaining() >= 0 and not alarm.fired
        excerpt: str | None = None
        try:
            excerpt = _excerpt(response.read(RESPONSE_EXCERPT_BYTES))
            response.read(_DRAIN_LIMIT)
            keep = response.isclosed() and not response.will_close and not alarm.fired
        except (OSError, http.client.HTTPException):
            pass  # the status decides; a body cut short by the deadline does not matter
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        if reused and isinstance(exc, _STALE) and not alarm.fired and remaining() > 0:
            return None
        if alarm.fired or remaining() <= 0 or isinstance(exc, TimeoutError):
            return False, status, f"timeout: no response within {deadline:g} s", None
        return False, status, f"connection failed: {_short(exc)}", None
    finally:
        _watchdog.disarm(alarm)
    if keep:
        _idle.give(key, conn)
    else:
        conn.close()
    if not in_time:
        return False, status, f"timeout: answered after more than {deadline:g} s", excerpt
    if 200 <= status < 300:
        return True, status, None, excerpt
    if 300 <= status < 400:
        return False, status, f"redirect ({status}) not followed", excerpt
    return False, status, f"HTTP {status}", excerpt
