"""Slow clients (slowloris) against `payintent serve` (gunicorn, gthread workers), directly and behind nginx.

A worker thread holds one connection from its first byte to its last. A few connections that send a request a byte
at a time hold every thread, and everyone else's requests wait: the service stops answering.
The production shape (docker-compose.yml) puts nginx in front with deploy/nginx.conf, which holds slow connections
itself and hands gunicorn only complete requests. These tests run that very file under Debian's nginx (`make
nginx`, a prerequisite of `make test`), rewriting only its listen address, its upstream and its /tmp/ paths.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from redis import Redis

from tests.conftest import free_port
from tests.observability.test_serve import start_serve

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
SLOW_CLIENTS = 24  # half trickle their header, half their body: under nginx's 32 connections per address
PATIENCE = 5.0  # seconds an ordinary request may take while the attack runs


def nginx_binary() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), "")
    if not found:
        pytest.fail("nginx is not installed: run `make nginx` (Debian: apt-get install nginx)")
    return found


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"deploy/nginx.conf should contain {old!r} exactly once"
    return text.replace(old, new)


def nginx_conf_for_test(listen_port: int, upstream_port: int, workdir: str) -> str:
    """deploy/nginx.conf with the test's addresses and paths, every other line as compose runs it."""
    text = NGINX_CONF.read_text()
    text = _replace_once(text, "listen 8080;", f"listen 127.0.0.1:{listen_port};")
    text = _replace_once(text, "server api:8000;", f"server 127.0.0.1:{upstream_port};")
    return text.replace("/tmp/", f"{workdir}/")


@pytest.fixture
def nginx_in_front() -> Iterator[Any]:
    """A function that starts nginx in front of a gunicorn port and returns the proxy's base URL."""
    binary = nginx_binary()
    # Readable by nginx's workers (`nobody` when the tests run as root): pytest's tmp_path is private to its owner.
    workdir = tempfile.mkdtemp(prefix="payintent-nginx-")
    os.chmod(workdir, 0o755)
    procs: list[subprocess.Popen[bytes]] = []

    def start(upstream_port: int) -> str:
        port = free_port()
        conf = Path(workdir) / "nginx.conf"
        conf.write_text(nginx_conf_for_test(port, upstream_port, workdir))
        with (Path(workdir) / "nginx.log").open("wb") as out:
            proc = subprocess.Popen([binary, "-p", workdir, "-c", str(conf), "-g", "daemon off;"],
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"nginx exited: {(Path(workdir) / 'nginx.log').read_text()}")
            try:
                if requests.get(f"{base}/healthz", timeout=2).status_code == 200:
                    return base
            except requests.RequestException:
                pass
            time.sleep(0.2)
        pytest.fail(f"nginx did not answer on {base}: {(Path(workdir) / 'nginx.log').read_text()}")

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)
    shutil.rmtree(workdir, ignore_errors=True)


class Slowloris:
    """``count`` connections to ``port`` that send a POST one byte per ``interval`` seconds, on a thread: half
    never finish their header, the others send a whole header announcing a body they never finish."""

    def __init__(self, port: int, count: int = SLOW_CLIENTS, interval: float = 1.0) -> None:
        self.port, self.count, self.interval = port, count, interval
        self.sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)

    def __enter__(self) -> Slowloris:
        path = f"/api/v1/checkout/intents/{uuid.uuid4()}/pay"
        for n in range(self.count):
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            head = f"POST {path} HTTP/1.1\r\nHost: pay.example.com\r\nContent-Type: application/json\r\n"
            if n % 2:
                head += "Content-Length: 4096\r\n\r\n{"  # a body that comes a byte at a time
            else:
                head += "X-Slow: "  # a header line that never ends
            sock.sendall(head.encode())
            self.sockets.append(sock)
        self._thread.start()
        return self

    def _trickle(self) -> None:
        while not self._stop.wait(self.interval):
            for sock in self.sockets:
                with contextlib.suppress(OSError):  # closed by the server: an attacker would reconnect
                    sock.send(b" ")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for sock in self.sockets:
            sock.close()


def ordinary_requests(base: str) -> list[tuple[int, float]]:
    """A health check and an API call (a 401 from the app itself): each one's status and seconds taken."""
    answers = []
    for method, path in (("GET", "/healthz"), ("POST", "/api/v1/x402/intents")):
        started = time.monotonic()
        answer = requests.request(method, f"{base}{path}", json={"amount_usdc": 1}, timeout=PATIENCE)
        answers.append((answer.status_code, time.monotonic() - started))
    return answers


def test_slow_clients_stall_gunicorn_reached_directly(tmp_path, stub_rpc):
    """The attack itself: with nothing in front, 24 slow connections leave no thread for an ordinary request.
    One worker of 4 threads: with two, how the connections spread over them decides whether one is left free."""
    proc, base = start_serve(tmp_path, stub_rpc, workers=1, WEB_THREADS="4")
    try:
        with Slowloris(int(base.rsplit(":", 1)[1])):
            time.sleep(2)  # every thread has taken a slow connection
            with pytest.raises(requests.Timeout):
                requests.get(f"{base}/healthz", timeout=PATIENCE)
        # The attackers gone, the threads come back.
        assert requests.get(f"{base}/healthz", timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_behind_nginx_slow_clients_do_not_stall_the_api(tmp_path, stub_rpc, nginx_in_front):
    proc, direct = start_serve(tmp_path, stub_rpc, workers=2, TRUSTED_PROXY_HOPS="1")
    try:
        base = nginx_in_front(int(direct.rsplit(":", 1)[1]))
        proxy_port = int(base.rsplit(":", 1)[1])
        with Slowloris(proxy_port):
            time.sleep(2)  # as long as the direct attack had to stall every thread
            for _ in range(3):
                answers = ordinary_requests(base)
                assert [status for status, _ in answers] == [200, 401], answers
                assert all(seconds < PATIENCE for _, seconds in answers), answers
                time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # None of the slow requests reached the app: nginx kept them (only the ordinary ones are in its request log).
    logged = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.strip()]
    assert "/api/v1/x402/intents" in {line.get("route") for line in logged}  # /healthz is not logged
    assert not [line for line in logged if "/checkout/intents/" in str(line.get("route"))]


def test_nginx_caps_connections_per_client_address(tmp_path, stub_rpc, nginx_in_front):
    """Past 32 connections of one address with a request under way, nginx answers 429 in the API's error shape."""
    proc, direct = start_serve(tmp_path, stub_rpc, workers=1, TRUSTED_PROXY_HOPS="1")
    sockets: list[socket.socket] = []
    try:
        base = nginx_in_front(int(direct.rsplit(":", 1)[1]))
        port = int(base.rsplit(":", 1)[1])
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /api/v1/x402/intents HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            sockets.append(sock)
            time.sleep(0.02)
        time.sleep(1)
        refused = []
        for sock in sockets:
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):  # still waiting for its body: counted
                refused.append(sock.recv(4096))
        assert len(refused) == 40 - 32, refused
        for answer in refused:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 429"), answer
            assert b"Retry-After: 10" in head
            assert json.loads(body)["error"]["code"] == "RATE_LIMITED"
    finally:
        for sock in sockets:
            sock.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_behind_nginx_rate_limits_count_the_real_client_whatever_it_claims(tmp_path, stub_rpc, nginx_in_front,
                                                                            redis_url):  # fmt: skip
    """TRUSTED_PROXY_HOPS=1 behind deploy/nginx.conf: a client's own X-Forwarded-For is replaced, not trusted."""
    proc, direct = start_serve(tmp_path, stub_rpc, workers=2, TRUSTED_PROXY_HOPS="1", REDIS_URL=redis_url,
                               API_AUTH_FAILURES_PER_MINUTE="3")  # fmt: skip
    try:
        base = nginx_in_front(int(direct.rsplit(":", 1)[1]))
        statuses = []
        for n in range(5):
            spoofed = {"X-Forwarded-For": f"203.0.113.{n}, 198.51.100.{n}", "Forwarded": f"for=192.0.2.{n}"}
            statuses.append(requests.get(f"{base}/api/v1/x402/intents", headers=spoofed, timeout=10).status_code)
        assert statuses == [401, 401, 401, 429, 429]
        keys = {key.decode() for key in Redis.from_url(redis_url).scan_iter("*rl:api:auth-failures:*")}
        assert [key.rsplit(":", 1)[1] for key in keys] == ["127.0.0.1"], keys  # one bucket: nginx's client
    finally:
        proc.terminate()
        proc.wait(timeout=30)
