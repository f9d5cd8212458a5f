"""A small JSON-RPC 2.0 server over HTTP (threaded), as Solana RPC clients expect it.

POST a request or a batch to ``/``; ``GET /health`` answers ``ok``. Bodies over 50 KiB (the
Solana node's limit) get 413. Every response allows any origin (CORS), so browser wallets and the
checkout page can call it. Errors are JSON-RPC error objects; a method that raises anything
(including pyo3's ``PanicException``, a ``BaseException``) answers ``-32603`` and the server keeps
serving. Requests without an ``id`` are notifications and get no answer.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
MAX_REQUEST_BYTES = 50 * 1024

Dispatch = Callable[[str, Any], Any]  # (method, params) -> result; raises RpcError


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_json(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def invalid_params(message: str) -> RpcError:
    return RpcError(INVALID_PARAMS, message)


def handle_body(dispatch: Dispatch, body: bytes, name: str = "jsonrpc") -> Any:
    """The response document for a request body (None: nothing to answer, only notifications)."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return _error_response(None, RpcError(PARSE_ERROR, "Parse error"))
    if isinstance(request, list):
        if not request:
            return _error_response(None, RpcError(INVALID_REQUEST, "Invalid request"))
        responses = [r for r in (handle_call(dispatch, item, name) for item in request) if r is not None]
        return responses or None
    return handle_call(dispatch, request, name)


def handle_call(dispatch: Dispatch, request: Any, name: str = "jsonrpc") -> dict[str, Any] | None:
    if not isinstance(request, dict):
        return _error_response(None, RpcError(INVALID_REQUEST, "Invalid request"))
    request_id = request.get("id")
    valid_id = request_id is None or (isinstance(request_id, str | int) and not isinstance(request_id, bool))
    if request.get("jsonrpc") != "2.0" or not isinstance(request.get("method"), str) or not valid_id:
        return _error_response(request_id if valid_id else None, RpcError(INVALID_REQUEST, "Invalid request"))
    is_notification = "id" not in request
    try:
        result = dispatch(request["method"], request.get("params"))
    except RpcError as exc:
        return None if is_notification else _error_response(request_id, exc)
    except BaseException as exc:  # including pyo3's PanicException: a bad request must never stop the server
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        print(f"{name}: {request['method']}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        error = RpcError(INTERNAL_ERROR, f"Internal error: {type(exc).__name__}")
        return None if is_notification else _error_response(request_id, error)
    return None if is_notification else {"jsonrpc": "2.0", "result": result, "id": request_id}


def _error_response(request_id: Any, error: RpcError) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "error": error.to_json(), "id": request_id}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as RPC clients expect
    timeout = 60  # an idle kept-alive connection frees its thread after this
    dispatch: Dispatch  # set on the subclass made by make_server
    name: str

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(HTTPStatus.LENGTH_REQUIRED, b"Content-Length required", "text/plain", close=True)
            return
        if length < 0 or length > MAX_REQUEST_BYTES:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"Request body too large", "text/plain", close=True)
            return
        document = handle_body(type(self).dispatch, self.rfile.read(length), self.name)
        payload = b"" if document is None else json.dumps(document, separators=(",", ":")).encode()
        self._send(HTTPStatus.OK, payload, "application/json")

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/health":
            self._send(HTTPStatus.OK, b"ok", "text/plain")
        else:
            message = b"Used HTTP Method is not allowed. POST or OPTIONS is required"
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, message, "text/plain")

    def do_OPTIONS(self) -> None:  # CORS preflight (browser wallets)
        self.send_response(HTTPStatus.OK)
        self.send_header("Access-Control-Allow-Methods", "POST, GET, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", self.headers.get("Access-Control-Request-Headers") or "*")
        self.send_header("Access-Control-Max-Age", "86400")
        self._cors_and_end(0)

    def _send(self, status: HTTPStatus, payload: bytes, content_type: str, *, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self._cors_and_end(len(payload))
        self.wfile.write(payload)

    def _cors_and_end(self, length: int) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # quiet: a line per request is noise
        pass


class JsonRpcServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def make_server(dispatch: Dispatch, host: str, port: int, *, name: str = "jsonrpc") -> JsonRpcServer:
    attributes = {"dispatch": staticmethod(dispatch), "name": name, "server_version": f"payintent-{name}"}
    handler = type("BoundHandler", (Handler,), attributes)
    return JsonRpcServer((host, port), handler)
