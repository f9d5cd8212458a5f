"""Target checks on resolved addresses (no network needed: literals and the loopback name)."""

from __future__ import annotations

import http.client
import ipaddress
import socket
import threading
import time
import uuid
from typing import Any

import pytest

from backend.webhooks import transport
from backend.webhooks.transport import TargetRefused, address_allowed, post, resolve
from tests.webhooks.helpers import HUNG_SUFFIX


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.0.0.5", False),
        ("172.16.3.4", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),  # loopback wrapped in IPv6
        ("::ffff:10.0.0.1", False),
        ("224.0.0.1", False),
    ],
)
def test_only_public_unicast_addresses_are_allowed(address, allowed):
    assert address_allowed(ipaddress.ip_address(address)) is allowed


def test_names_are_checked_on_every_resolved_address():
    with pytest.raises(TargetRefused, match="not a public address"):
        resolve("localhost", 80, allow_private=False)
    assert resolve("localhost", 80, allow_private=True) in {"127.0.0.1", "::1"}


def test_a_refused_target_is_never_contacted():
    result = post("http://127.0.0.1:9/hook", b"{}", {}, allow_private=False)
    assert not result.succeeded
    assert result.status_code is None
    assert result.error.startswith("refused:")


@pytest.mark.parametrize(
    "address",
    ["64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "2002:7f00:1::", "::7f00:1", "::ffff:0:7f00:1", "fec0::1",
     "2001::1", "64:ff9b:1::1"],
)  # fmt: skip
def test_ipv6_forms_embedding_a_private_ipv4_are_refused(address):
    assert address_allowed(ipaddress.ip_address(address)) is False


def test_nat64_of_a_public_address_is_allowed():
    assert address_allowed(ipaddress.ip_address("64:ff9b::808:808")) is True  # 8.8.8.8


class _Trickle:
    """A raw TCP server that answers slowly, one byte at a time."""

    def __init__(self, head: bytes, body: bytes, head_gap: float, body_gap: float) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.head, self.body, self.head_gap, self.body_gap = head, body, head_gap, body_gap
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        try:
            conn.recv(65536)
            for data, gap in ((self.head, self.head_gap), (self.body, self.body_gap)):
                for i in range(len(data)):
                    conn.sendall(data[i : i + 1])
                    time.sleep(gap)
        except OSError:
            pass
        finally:
            conn.close()
            self.sock.close()


def test_a_trickling_status_line_is_cut_at_the_deadline():
    server = _Trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"ok", head_gap=0.2, body_gap=0)
    started = time.monotonic()
    result = post(f"http://127.0.0.1:{server.port}/", b"{}", {}, allow_private=True, deadline=1.0)
    elapsed = time.monotonic() - started
    assert not result.succeeded and result.error.startswith("timeout")
    assert 1.0 <= elapsed < 1.5


def test_a_trickling_body_does_not_hold_the_sender_past_the_deadline():
    server = _Trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"x" * 100, head_gap=0, body_gap=0.1)
    started = time.monotonic()
    result = post(f"http://127.0.0.1:{server.port}/", b"{}", {}, allow_private=True, deadline=1.0)
    assert time.monotonic() - started < 1.5
    assert result.succeeded and result.status_code == 200  # the 2xx came in time; the body does not matter


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://" + ".".join(["a" * 63] * 8) + "/", "not a valid host name"),
        ("http://example.com:99999/", "not a valid port"),
    ],
)
def test_odd_urls_fail_as_an_attempt_never_as_an_exception(url, message):
    result = post(url, b"{}", {}, allow_private=True, deadline=1.0)
    assert not result.succeeded and result.error.startswith("refused:") and message in result.error


def test_an_internationalised_host_is_encoded_not_crashed_on():
    result = post("http://例え.jp/", b"{}", {}, allow_private=True, deadline=1.0)  # no DNS here, or a real answer
    assert not result.succeeded or result.status_code is not None


class _KeepAliveThenHangUp:
    """Answers 200 with keep-alive, then closes each connection shortly after (an idle timeout)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            time.sleep(0.1)
            conn.close()


def test_a_connection_closed_while_idle_is_replaced_within_the_attempt():
    server = _KeepAliveThenHangUp()
    url = f"http://127.0.0.1:{server.port}/hook"
    assert post(url, b"{}", {}, allow_private=True).succeeded
    time.sleep(0.3)  # the receiver hangs up the idle connection
    second = post(url, b"{}", {}, allow_private=True)
    assert second.succeeded and second.status_code == 200
    assert server.connections == 2


def test_connections_are_kept_alive_between_attempts(receiver):
    for _ in range(3):
        assert post(receiver.url(), b"{}", {}, allow_private=True).succeeded
    ports = {r.client_port for r in receiver.requests}
    assert len(receiver.requests) == 3
    assert len(ports) == 1


# --- name resolution that does not answer ------------------------------------------------------


def _hung_url(label: str) -> str:
    return f"http://{label}-{uuid.uuid4().hex[:8]}{HUNG_SUFFIX}/hook"


def test_lookups_that_never_answer_do_not_block_other_names(hung_dns):
    results: list[Any] = []
    urls = [_hung_url(f"h{n}") for n in range(12)]  # more than any fixed pool of resolver threads
    threads = [
        threading.Thread(target=lambda u=u: results.append(post(u, b"{}", {}, allow_private=True, deadline=1.0)))
        for u in urls
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(results) == 12
    assert all(not r.succeeded and r.error.startswith("refused: resolving the host took") for r in results)
    # The twelve lookups are still running (getaddrinfo cannot be cancelled); other names resolve at once.
    started = time.monotonic()
    assert resolve("localhost", 80, allow_private=True, timeout=1.0) in {"127.0.0.1", "::1"}
    assert time.monotonic() - started < 0.5


def test_a_name_that_did_not_answer_fails_at_once_for_a_while(hung_dns):
    url = _hung_url("once")
    started = time.monotonic()
    first = post(url, b"{}", {}, allow_private=True, deadline=1.0)
    assert 0.9 <= time.monotonic() - started < 1.5
    assert not first.succeeded and "took longer than" in first.error
    started = time.monotonic()
    second = post(url, b"{}", {}, allow_private=True, deadline=1.0)
    assert time.monotonic() - started < 0.2  # no second lookup, no second wait
    assert not second.succeeded and second.error.startswith("refused:") and "did not answer" in second.error
    assert len(hung_dns) == 1


def test_name_resolution_has_its_own_shorter_bound(hung_dns):
    started = time.monotonic()
    result = post(_hung_url("bound"), b"{}", {}, allow_private=True, deadline=10.0, dns_timeout=0.5)
    assert 0.4 <= time.monotonic() - started < 1.0
    assert not result.succeeded and "took longer than 0.5 s" in result.error


def test_one_owners_unanswered_lookups_are_capped_and_others_are_not(hung_dns):
    owner = f"m_{uuid.uuid4().hex[:8]}"
    for n in range(transport.MAX_UNANSWERED_LOOKUPS_PER_OWNER):
        result = post(_hung_url(f"o{n}"), b"{}", {}, allow_private=True, deadline=1.0, dns_timeout=0.2, owner=owner)
        assert "took longer than" in result.error
    started = time.monotonic()
    capped = post(_hung_url("more"), b"{}", {}, allow_private=True, deadline=1.0, owner=owner)
    assert time.monotonic() - started < 0.2
    assert capped.error.startswith("refused:") and "unanswered" in capped.error
    # The cap is the owner's: another merchant's name still resolves (and localhost is contacted).
    assert resolve("localhost", 80, allow_private=True, timeout=1.0, owner="m_other") in {"127.0.0.1", "::1"}


def test_a_trickling_tls_handshake_is_cut_at_the_deadline():
    # A TLS record header announcing a long handshake message, then one byte at a time.
    server = _Trickle(b"\x16\x03\x03\x3e\x80", b"\x02" * 200, head_gap=0, body_gap=0.2)
    started = time.monotonic()
    result = post(f"https://127.0.0.1:{server.port}/", b"{}", {}, allow_private=True, deadline=1.0)
    assert time.monotonic() - started < 1.5
    assert not result.succeeded and result.error.startswith("timeout")


def test_a_deadline_that_passes_while_connecting_still_cuts_the_connection_once_it_exists():
    # The watchdog fires before the socket exists (a connect that completes at the last moment): the
    # socket must still be shut when it appears, or a trickled handshake or answer would run on.
    server = _Trickle(b"HTTP/1.1 200 OK\r\n", b"", head_gap=0.2, body_gap=0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    alarm = transport._watchdog.arm(conn, 0.01)
    time.sleep(0.1)  # fired, nothing to shut yet
    assert alarm.fired
    started = time.monotonic()
    conn.connect()
    conn.request("POST", "/", b"{}")
    with pytest.raises((OSError, http.client.HTTPException)):
        conn.getresponse()
    transport._watchdog.disarm(alarm)
    assert time.monotonic() - started < 1.0  # not the 17 x 0.2 s of the trickle, nor the 5 s timeout
