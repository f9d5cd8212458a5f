"""The proxies in front of a chain's RPC, each a helper server (``python -m harness.proxy <kind> ...``):

- ``forward``: a TCP forwarder to one upstream port, on a fixed port, so that a drill can stop "the chain
  RPC" (connections refused) and start it again without touching Anvil's state. With ``--control FILE`` it
  forwards HTTP requests one by one instead of bytes, and can lose answers at run time (``set_loss``): while
  the file asks it to, a fraction of the requests reach the upstream and their answer never comes back;
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
import random
import subprocess
import sys
import threading
import time
from collections import Counter
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


def start_forwarder(
    procs: ProcessSet, port: int, upstream_port: int, log: Path, what: str, control: Path | None = None
) -> subprocess.Popen[str]:
    """A forwarder process listening on ``port`` (fixed: it comes back on the same one after a kill); with a
    ``control`` file, the HTTP forwarder that loses answers when the file says so (``set_loss``)."""
    args = ["forward", "--port", str(port), "--upstream", str(upstream_port)]
    if control is not None:
        args += ["--control", str(control)]
    proc, _ = start_helper(procs, "harness.proxy", args, log, what)
    return proc


# --- the HTTP forwarder that loses answers -------------------------------------------------------


# Requests whose lost answer hurts most: the call took effect and its caller does not know (a sent transaction),
# or many answers go at once (a JSON-RPC batch). ``set_loss`` may lose other calls' answers less often.
WRITES = frozenset({"eth_sendRawTransaction", "eth_sendTransaction"})


def set_loss(control: Path, fraction: float, seed: int = 0, reads: float | None = None) -> None:
    """From now on the forwarder reading ``control`` loses the answer to ``fraction`` of the requests (0: none),
    and to ``reads`` (default: ``fraction``) of the single calls that are not WRITES: each request still reaches
    the upstream, which answers it, and then the client's connection is closed with no answer (a drop) or after
    the answer's headers and half its body (a cut: a batch's answer lost halfway). Which requests: a
    ``random.Random(seed)`` draws two numbers per request, in the order the requests come."""
    setting = {"fraction": fraction, "reads": fraction if reads is None else reads, "seed": seed}
    tmp = control.with_suffix(".tmp")
    tmp.write_text(json.dumps(setting) if fraction > 0 or setting["reads"] > 0 else "")
    tmp.replace(control)


class Loss:
    """What the control file asks for, looked at before each request; each ``set_loss`` (a new file: its inode)
    starts its own random sequence. When a setting that lost answers ends, what it saw is a line on stderr:
    ``seen <reads> reads, <sends> sends, <batches> batches``."""

    def __init__(self, control: Path) -> None:
        self.control = control
        self.version: tuple[int, int] | None = None
        self.fraction = self.reads = 0.0
        self.rng = random.Random(0)
        self.count = 0
        self.seen: Counter[str] = Counter()

    def decide(self, methods: str) -> str | None:
        """None (answer), "drop" or "cut", for the next request (its ``_methods``)."""
        try:
            stat = self.control.stat()
            version: tuple[int, int] | None = (stat.st_ino, stat.st_mtime_ns)
        except OSError:
            version = None
        if version != self.version:
            if self.count:
                seen = ", ".join(f"{self.seen[kind]} {kind}" for kind in ("reads", "sends", "batches"))
                print(f"seen {seen}", file=sys.stderr, flush=True)
            self.version, self.count, self.seen = version, 0, Counter()
            text = self.control.read_text() if version is not None else ""
            setting = json.loads(text) if text.strip() else {}
            self.fraction = float(setting.get("fraction", 0))
            self.reads = float(setting.get("reads", self.fraction))
            self.rng = random.Random(int(setting.get("seed", 0)))
        if self.fraction <= 0 and self.reads <= 0:
            return None
        self.count += 1
        kind = "batches" if methods.startswith("batch[") else "sends" if methods in WRITES else "reads"
        self.seen[kind] += 1
        fraction = self.reads if kind == "reads" else self.fraction
        lost, cut = self.rng.random() < fraction, self.rng.random() < 0.5
        return ("cut" if cut else "drop") if lost else None


def _methods(body: bytes) -> str:
    """The JSON-RPC methods of a request, for the log: ``eth_x`` or ``batch[3] eth_x,eth_y``."""
    try:
        request = json.loads(body)
    except ValueError:
        return "?"
    if isinstance(request, list):
        names = sorted({str(call.get("method")) for call in request if isinstance(call, dict)})
        return f"batch[{len(request)}] {','.join(names)}"
    return str(request.get("method")) if isinstance(request, dict) else "?"


def lossy_forwarder(upstream_port: int, control: Path) -> Handler:
    """A connection handler that forwards each HTTP request (a JSON-RPC call or batch) to HOST:upstream_port on
    a connection of its own and sends the answer back, or loses it as ``control`` says (``Loss``). Each lost
    answer is a line on stderr: ``lost <n> drop|cut <methods>``."""
    loss = Loss(control)

    async def exchange(upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes) -> bytes:
        up_reader, up_writer = upstream
        up_writer.write(request)
        await up_writer.drain()
        answer = bytearray()
        await _read_message(up_reader, answer)
        return bytes(answer)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                request = bytearray()
                try:
                    _, body = await _read_message(reader, request)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                answer: bytes | None = None
                for attempt in range(2):  # a kept upstream connection the upstream has closed: once more
                    reused = upstream is not None
                    if upstream is None:
                        try:
                            upstream = await asyncio.open_connection(HOST, upstream_port)
                        except OSError:
                            return  # refused upstream: closed, as the byte forwarder does
                    try:
                        answer = await exchange(upstream, bytes(request))
                        break
                    except (asyncio.IncompleteReadError, ConnectionError) as exc:
                        upstream[1].close()
                        upstream = None
                        partial = getattr(exc, "partial", b"")
                        if not reused or partial or attempt:
                            return
                if answer is None:
                    return
                if b"\r\nconnection: close" in answer.split(b"\r\n\r\n", 1)[0].lower() and upstream is not None:
                    upstream[1].close()
                    upstream = None
                methods = _methods(body)
                what = loss.decide(methods)
                if what is not None:
                    print(f"lost {loss.count} {what} {methods}", file=sys.stderr, flush=True)
                    if what == "cut":
                        head = answer.index(b"\r\n\r\n") + 4
                        writer.write(answer[: head + (len(answer) - head) // 2])
                        await writer.drain()
                    return
                writer.write(answer)
                await writer.drain()
        except (ConnectionError, OSError):
            return
        finally:
            if upstream is not None:
                upstream[1].close()
            with contextlib.suppress(Exception):
                writer.close()

    return handle


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


async def _read_message(reader: asyncio.StreamReader, raw: bytearray | None = None) -> tuple[bytes, bytes]:
    """One HTTP/1.1 message: (first line, body). Content-Length or chunked bodies. ``raw``: gets the message's
    bytes as they came."""
    raw = bytearray() if raw is None else raw
    head = await reader.readuntil(b"\r\n\r\n")
    raw += head
    first, *lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            raw += line + chunk
            if size == 0:
                return first, bytes(body)
            body += chunk[:-2]
    length = int(headers.get(b"content-length", b"0"))
    data = await reader.readexactly(length) if length else b""
    raw += data
    return first, data


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
    parser.add_argument("--control", type=Path, help="forward: HTTP requests, losing answers as this file says")
    args = parser.parse_args(argv)
    if args.kind == "forward" and args.control is not None:
        return run_server(lossy_forwarder(args.upstream, args.control), args.port)
    if args.kind == "forward":
        return run_server(forwarder(args.upstream), args.port)
    return run_server(recording_handler({str(k): int(v) for k, v in json.loads(args.upstreams).items()}), args.port)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
