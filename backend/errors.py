"""The API's error model: ``{success: false, error: {code, message, ...}}``.

Codes are stable UPPER_SNAKE strings; each has one HTTP status. Views and services raise
:class:`APIError`; the handlers registered by :func:`register_error_handlers` turn it, and
every other failure, into that envelope. No stack trace ever reaches a client.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from flask import Flask, Response, current_app, request
from sqlalchemy.exc import DBAPIError, OperationalError
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """A failure to report to the API caller."""

    def __init__(
        self, http_status: int, code: str, message: str, *, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"success": False, "error": {"code": self.code, "message": self.message, **self.extra}}


# What an error message may repeat of the client's own text (a network id, a field name, a version): at most
# ECHO_LIMIT characters, of a set that cannot be read as markup, a control character or another line.
ECHO_LIMIT = 64
MAX_ERROR_FIELDS = 20
_UNSAFE = re.compile(r"[^A-Za-z0-9 _.,:;/@+=#~()\[\]-]")


def echo(value: object, limit: int = ECHO_LIMIT, *, quoted: bool = True) -> str:
    """Client-supplied ``value`` as an error message may show it: its first ``limit`` characters, every one
    outside a plain set (letters, digits, space, ``_.,:;/@+=#~()[]-``) shown as ``?``, ``...`` when cut,
    in single quotes unless ``quoted`` is false."""
    text = value if isinstance(value, str) else repr(value)
    shown = _UNSAFE.sub("?", text[:limit]) + ("..." if len(text) > limit else "")
    return f"'{shown}'" if quoted else shown


def _bounded_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Field names come from the client (an unknown field is named): at most MAX_ERROR_FIELDS, each echoed
    safely, two levels deep (where our schemas nest)."""
    bounded: dict[str, Any] = {}
    for name, detail in list(fields.items())[:MAX_ERROR_FIELDS]:
        if isinstance(detail, dict):
            detail = {echo(k, quoted=False): v for k, v in list(detail.items())[:MAX_ERROR_FIELDS]}
        bounded[echo(name, quoted=False)] = detail
    return bounded


def validation_error(fields: dict[str, Any], message: str | None = None) -> APIError:
    """400 VALIDATION_ERROR naming each bad field (client-supplied names bounded: :func:`echo`)."""
    fields = _bounded_fields(fields)
    if message is None:
        first = next(iter(fields), "request")
        detail = fields[first]
        while isinstance(detail, dict) and detail:
            first, detail = f"{first}.{next(iter(detail))}", next(iter(detail.values()))
        if isinstance(detail, list) and detail:
            detail = detail[0]
        message = f"{first}: {detail}"
    return APIError(400, "VALIDATION_ERROR", message, fields=fields)


def not_found(what: str = "Resource") -> APIError:
    return APIError(404, "NOT_FOUND", f"{what} not found")


# Status and code for plain HTTP errors raised by Flask/Werkzeug (routing, size limits...).
_HTTP_CODES = {
    400: "BAD_REQUEST",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    409: "CONFLICT",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    429: "RATE_LIMITED",
}


def error_response(err: APIError) -> Response:
    response = current_app.response_class(current_app.json.dumps(err.body()), mimetype="application/json")
    response.status_code = err.http_status
    response.headers.update(err.headers)
    return response


def _handle_api_error(err: APIError) -> Response:
    return error_response(err)


def _handle_http_exception(exc: HTTPException) -> Response:
    status = exc.code or 500
    data = getattr(exc, "data", None) or {}
    messages = data.get("messages") if isinstance(data, dict) else None
    if status in (400, 422) and messages is not None:
        # webargs/marshmallow validation: {location: {field: [msg]}}; flatten the location.
        fields: dict[str, Any] = {}
        for location_fields in messages.values():
            if isinstance(location_fields, dict):
                fields.update(location_fields)
        return error_response(validation_error(fields or {"request": ["is invalid"]}))
    code = _HTTP_CODES.get(status, "HTTP_ERROR" if status < 500 else "INTERNAL_ERROR")
    message = exc.description if status < 500 else "Internal server error"
    response = error_response(APIError(status, code, message or code))
    if status == 405 and hasattr(exc, "valid_methods") and exc.valid_methods:
        response.headers["Allow"] = ", ".join(exc.valid_methods)
    return response


def database_unavailable(exc: Exception) -> bool:
    """The database cannot be reached or answer now (down, restarting, refusing connections, a connection
    timeout, a dropped connection, SQLite busy): worth retrying, unlike a failing statement."""
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def _handle_database_error(exc: DBAPIError) -> Response:
    if not database_unavailable(exc):
        return _handle_unexpected(exc)
    log.error("database unavailable on %s %s: %s", request.method, request.path, exc.orig or exc)
    return error_response(APIError(503, "SERVICE_UNAVAILABLE", "The database cannot be reached right now; try again"))


def _handle_unexpected(exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(APIError(500, "INTERNAL_ERROR", "Internal server error"))


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(APIError, _handle_api_error)
    app.register_error_handler(HTTPException, _handle_http_exception)
    app.register_error_handler(DBAPIError, _handle_database_error)
    app.register_error_handler(Exception, _handle_unexpected)
