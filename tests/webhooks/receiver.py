"""A real HTTP receiver for webhook tests: records raw bodies and headers, answers as each path says.

Paths choose the behaviour: ``/ok``, ``/status/<code>`` (e.g. 500, 302), ``/slow/<seconds>`` (answers
200 after sleeping). A receiver that is down is a URL on a port nobody listens on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    body: bytes
    headers: dict[str, str]
    at: float
    client_port: int = 0


@dataclass
class Receiver:
    server: ThreadingHTTPServer
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str = "/ok") -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}{path}"

    def on(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    def wait_for(self, count: int, path: str | None = None, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.on(path) if path else list(self.requests)
            if len(got) >= count:
                return got
            time.sleep(0.01)
        raise AssertionError(f"expected {count} requests, got {len(self.on(path) if path else self.requests)}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_receiver(host: str = "127.0.0.1") -> Receiver:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with receiver.lock:
                receiver.requests.append(
                    Received(self.path, body, dict(self.headers.items()), time.monotonic(), self.client_address[1])
                )
            parts = self.path.strip("/").split("/")
            status = 200
            if parts[0] == "status":
                status = int(parts[1])
            elif parts[0] == "slow":
                time.sleep(float(parts[1]))
            answer = b'{"received": true}' if status < 300 else b"receiver says no"
            self.send_response(status)
            if 300 <= status < 400:
                self.send_header("Location", receiver.url("/ok"))
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = ThreadingHTTPServer((host, 0), Handler)
    server.daemon_threads = True
    receiver = Receiver(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver
