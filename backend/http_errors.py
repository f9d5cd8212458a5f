"""The REST API's translation of errors: ``{success: false, error: {code, message, ...}}``.

A :class:`~backend.errors.DomainError` is answered with its catalog status, its headers and its body; a
Flask/Werkzeug HTTP error, an unreachable database and any other failure get the same envelope. No stack
trace ever reaches a client.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, current_app, request
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.exceptions import HTTPException

from backend.errors import CATALOG, DomainError, database_unavailable, validation_error

log = logging.getLogger(__name__)

# Code for plain HTTP errors raised by Flask/Werkzeug (routing, size limits...); each is in the catalog with
# that status. Another status below 500 is HTTP_ERROR, one from 500 INTERNAL_ERROR.
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


def _response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    response = current_app.response_class(current_app.json.dumps(body), mimetype="application/json")
    response.status_code = status
    response.headers.update(headers or {})
    return response


def error_response(err: DomainError) -> Response:
    return _response(err.http_status, err.body(), err.headers)


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
    message = exc.description if status < 500 else CATALOG["INTERNAL_ERROR"].description
    response = _response(status, {"success": False, "error": {"code": code, "message": message or code}})
    if status == 405 and hasattr(exc, "valid_methods") and exc.valid_methods:
        response.headers["Allow"] = ", ".join(sorted(exc.valid_methods))  # the router keeps a set: one order
    return response


def _handle_database_error(exc: DBAPIError | PoolTimeout) -> Response:
    if not database_unavailable(exc):
        return _handle_unexpected(exc)
    log.error("database unavailable on %s %s: %s", request.method, request.path, getattr(exc, "orig", None) or exc)
    return error_response(DomainError("SERVICE_UNAVAILABLE", "The database cannot be reached right now; try again"))


def _handle_unexpected(exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(DomainError("INTERNAL_ERROR", "Internal server error"))


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(DomainError, error_response)
    app.register_error_handler(HTTPException, _handle_http_exception)
    app.register_error_handler(DBAPIError, _handle_database_error)
    app.register_error_handler(PoolTimeout, _handle_database_error)  # every pooled connection taken: busy, not broken
    app.register_error_handler(Exception, _handle_unexpected)
