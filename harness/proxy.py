"""The proxies in front of a chain's RPC, each a helper server (``python -m harness.proxy <kind> ...``):

- ``forward``: a TCP forwarder to one upstream port, on a fixed port, so that a drill can stop "the chain
  RPC" (connections refused) and start it again without touching Anvil's state;
- ``record``: the JSON-RPC recording proxy of the benchmarks: forwards each request to the upstream chain
  named by its path (``/<chain id>``) and records when it came, when it was answered and what it was;
  ``GET /__records`` answers (and clears) the records, each a ``Call``.

And in the tests' own process (a thread per connection, no helper process): ``RpcServer``, a JSON-RPC endpoint
over real HTTP that answers what its ``handle`` returns (a scripted node), and ``RpcProxy``, one that forwards to
a real chain's RPC (a test's subclass rewrites, counts or withholds calls).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import requests

from harness.errors import HarnessError
from harness.ports import HOST
from harness.processes import ProcessSet
from harness.servers import Handler, run_server, start_helper

RECEIPT = "eth_getTransactionReceipt"


# --- the TCP forwarder ---------------------------------------------------------------------------


def forwarder(upstream_port: int) -> Handler:
    """A connection handler that pipes bytes both ways to HOST:upstream_port (refused upstream: closed)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, upstream_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return handle


def start_forwarder(procs: ProcessSet, port: int, upstream_port: int, log: Path, what: str) -> subprocess.Popen[str]:
    """A forwarder process listening on ``port`` (fixed: it comes back on the same one after a kill)."""
    args = ["forward", "--port", str(port), "--upstream", str(upstream_port)]
    proc, _ = start_helper(procs, "harness.proxy", args, log, what)
    return proc


# --- the JSON-RPC recording proxy ----------------------------------------------------------------


@dataclass
class Call:
    """One JSON-RPC call through the recording proxy."""

    conn: int
    t_in: float
    t_out: float
    method: str
    ident: str | None
    found: bool
    error: str | None = None

    @property
    def seconds(self) -> float:
        return self.t_out - self.t_in


async def _read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 message: (first line, body). Content-Length or chunked bodies."""
    head = await reader.readuntil(b"\r\n\r\n")
    first, *lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return first, bytes(body)
            body += chunk[:-2]
    length = int(headers.get(b"content-length", b"0"))
    return first, (await reader.readexactly(length) if length else b"")


def describe_call(body: bytes, answer: bytes) -> tuple[str, str | None, bool, str | None]:
    """(method, what ties the call to a payment: an address in the call data or a tx hash, answered
    non-null, the JSON-RPC error if the answer is one)."""
    try:
        request = json.loads(body)
        method = str(request.get("method"))
        params = request.get("params") or []
    except (ValueError, AttributeError):
        return "?", None, False, None
    error = None
    if b'"error"' in answer:
        with contextlib.suppress(ValueError, AttributeError):
            error = json.dumps(json.loads(answer).get("error"))[:300]
    ident = None
    found = True
    if method in ("eth_call", "eth_estimateGas") and params and isinstance(params[0], dict):
        data = str(params[0].get("data") or params[0].get("input") or "")
        if len(data) >= 74:
            ident = "0x" + data[34:74].lower()  # the first argument: balanceOf/authorizationState/transfer's from
    elif method == RECEIPT and params:
        ident = str(params[0]).lower()
        found = b'"result":null' not in answer.replace(b" ", b"")
    elif method == "eth_sendRawTransaction":
        with contextlib.suppress(ValueError, AttributeError):
            ident = str(json.loads(answer).get("result") or "").lower() or None
    return method, ident, found, error


def recording_handler(upstreams: dict[str, int]) -> Handler:
    """The recording proxy's connection handler: forwards each JSON-RPC request to the upstream chain named
    by its path and records it; GET /__records answers (and clears) the records."""
    records: list[list[Any]] = []
    connection_ids = itertools.count(1)

    def response(status: bytes, body: bytes) -> bytes:
        head = b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (status, len(body))
        return head + body

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cid = next(connection_ids)
        upstream: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        body = b""
        try:
            while True:
                try:
                    first, body = await _read_message(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                t_in = time.time()
                key = first.split(b" ")[1].decode().strip("/")
                if key == "__records":
                    writer.write(response(b"200 OK", json.dumps(records).encode()))
                    records.clear()
                    await writer.drain()
                    continue
                target = upstreams.get(key)
                if target is None:
                    writer.write(response(b"404 Not Found", b"{}"))
                    await writer.drain()
                    continue
                request = (
                    b"POST / HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                )
                status_line = answer = b""
                for attempt in range(2):
                    if key not in upstream:
                        upstream[key] = await asyncio.open_connection(HOST, target)
                    up_reader, up_writer = upstream[key]
                    try:
                        up_writer.write(request % (HOST.encode(), target, len(body)) + body)
                        await up_writer.drain()
                        status_line, answer = await _read_message(up_reader)
                        break
                    except (asyncio.IncompleteReadError, ConnectionError):
                        upstream.pop(key)
                        up_writer.close()
                        if attempt:
                            raise
                if not status_line.startswith(b"HTTP/1.1 200"):
                    print(f"proxy: upstream {key} answered {status_line!r} to {body[:200]!r}", file=sys.stderr)
                writer.write(response(status_line.split(b" ", 1)[1], answer))
                await writer.drain()
                t_out = time.time()
                records.append([cid, t_in, t_out, *describe_call(body, answer)])
        except Exception as exc:
            print(f"proxy: connection {cid} failed ({exc!r}) after {body[:200]!r}", file=sys.stderr, flush=True)
            raise
        finally:
            for _, up_writer in upstream.values():
                up_writer.close()
            writer.close()

    return handle


def start_recording_proxy(
    procs: ProcessSet, upstreams: dict[str, int], log: Path, port: int = 0
) -> tuple[subprocess.Popen[str], int]:
    """The recording proxy in front of ``upstreams`` (chain id -> Anvil's port); the process and its port,
    once it answers. The chains' RPC URL through it: ``http://127.0.0.1:<port>/<chain id>``."""
    args = ["record", "--port", str(port), "--upstreams", json.dumps(upstreams)]
    proc, bound = start_helper(procs, "harness.proxy", args, log, "RPC proxy")
    proxy_records(bound)  # it answers
    return proc, bound


def proxy_records(port: int) -> list[Call]:
    """The calls the recording proxy on ``port`` saw since the last time (it forgets them)."""
    import http.client

    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        conn.request("GET", "/__records")
        answer = conn.getresponse()
        raw = answer.read()
    finally:
        conn.close()
    if answer.status != 200:
        raise HarnessError(f"the RPC proxy answered {answer.status}")
    return [Call(*row) for row in json.loads(raw)]


# --- in-process JSON-RPC servers (tests) ---------------------------------------------------------


class DropConnection(Exception):
    """Raised by an ``RpcServer``'s ``handle``: the connection is closed with no answer (the client sees a reset)."""


@dataclass
class Reply:
    """What ``handle`` returns for an HTTP status other than 200 (any other value is the JSON answered 200)."""

    body: Any
    status: int = 200


class RpcServer:
    """A JSON-RPC endpoint over real HTTP on HOST, served by a thread in this process (a thread per connection):
    each POST's JSON body (a call or a batch) goes to ``handle``, whose result is answered as JSON. ``url``;
    ``close()``, or use it as a context manager. Attributes ``handle`` reads are set before ``__init__`` runs
    (it serves at once)."""

    def __init__(self, *, poll_seconds: float = 0.5) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    answer = server.handle(body)
                except DropConnection:
                    self.close_connection = True
                    return
                reply = answer if isinstance(answer, Reply) else Reply(answer)
                data = json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(poll_seconds,), daemon=True)
        self.thread.start()

    def handle(self, body: Any) -> Any:
        """The answer to one request's JSON body (a ``Reply`` for another status; ``DropConnection``: none)."""
        raise NotImplementedError

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class RpcProxy(RpcServer):
    """An ``RpcServer`` in front of a chain's RPC at ``upstream``: forwards every request as it is, unless a
    subclass's ``handle`` does otherwise (``forward`` sends a body on)."""

    def __init__(self, upstream: str, *, poll_seconds: float = 0.5) -> None:
        self.upstream = upstream
        super().__init__(poll_seconds=poll_seconds)

    def handle(self, body: Any) -> Any:
        return self.forward(body)

    def forward(self, body: Any) -> Any:
        """The upstream's answer to ``body`` (a call or a batch)."""
        return requests.post(self.upstream, json=body, timeout=10).json()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("kind", choices=("forward", "record"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", type=int, default=0, help="forward: the upstream port")
    parser.add_argument("--upstreams", default="{}", help="record: JSON {chain id: upstream port}")
    args = parser.parse_args(argv)
    if args.kind == "forward":
        return run_server(forwarder(args.upstream), args.port)
    return run_server(recording_handler({str(k): int(v) for k, v in json.loads(args.upstreams).items()}), args.port)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
