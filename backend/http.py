"""HTTP plumbing shared by the API views: strict JSON parsing, JSON responses, error docs."""

from __future__ import annotations

from typing import Any

import flask_smorest
from flask import Request, Response, current_app
from marshmallow import EXCLUDE
from webargs.flaskparser import FlaskParser, is_json_request

from backend.errors import DomainError
from backend.jsonio import JSONParseError, JSONTooDeep, dumps, strict_loads
from backend.schemas import ErrorEnvelopeSchema
from payintent.jsonlimits import MAX_JSON_DEPTH, iter_strings

_ERROR_DESCRIPTIONS = {
    400: "Invalid request (VALIDATION_ERROR, INVALID_JSON, ...)",
    401: "Missing, unknown or revoked API key (UNAUTHORIZED)",
    404: "Not found, or not this merchant's (NOT_FOUND)",
    409: "Conflict with the current state",
    402: "The payment could not be settled (SETTLEMENT_FAILED, with a reason)",
    410: "The intent expired (INTENT_EXPIRED)",
    415: "Body is not application/json (UNSUPPORTED_MEDIA_TYPE)",
    503: "A chain, the settlement queue or the database is unavailable (CHAIN_UNAVAILABLE, SERVICE_UNAVAILABLE): retry",
    504: "Accepted but still settling (SETTLEMENT_PENDING): read the intent",
    422: "Idempotency-Key reused with a different request (IDEMPOTENCY_KEY_REUSED)",
    429: "Too many requests (RATE_LIMITED, or a settlement limit): retry after Retry-After seconds",
}
TOO_DEEP_MESSAGE = f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"


class StrictJSONParser(FlaskParser):
    """webargs parser that reads bodies with the service's exact JSON rules."""

    DEFAULT_VALIDATION_STATUS = 400  # the error handler turns it into VALIDATION_ERROR
    # Unknown body fields and query parameters are refused alike (schemas say RAISE).
    DEFAULT_UNKNOWN_BY_LOCATION = {"headers": EXCLUDE, "cookies": EXCLUDE}

    def _raw_load_json(self, req: Any) -> Any:
        body = req.get_data(cache=True)
        if not is_json_request(req):
            if body:
                raise DomainError("UNSUPPORTED_MEDIA_TYPE", "Send the body as Content-Type: application/json")
            return super()._raw_load_json(req)
        if not body:
            raise DomainError("INVALID_JSON", "The request body is empty; send a JSON object")
        return parse_json_body(body)


def parse_json_body(body: bytes) -> Any:
    """A request body as JSON, or 400 INVALID_JSON: not JSON, nested too deep (refused before parsing), or
    with a NUL in a string."""
    try:
        data = strict_loads(body)
    except JSONTooDeep:
        raise DomainError("INVALID_JSON", TOO_DEEP_MESSAGE) from None
    except JSONParseError as exc:
        raise DomainError("INVALID_JSON", f"The request body is not valid JSON: {exc}") from None
    if _has_nul(data):
        raise DomainError("INVALID_JSON", "Strings must not contain the NUL character (\\u0000)")
    return data


def _has_nul(value: Any) -> bool:
    return any("\x00" in text for text in iter_strings(value))


class JSONRequest(Request):
    """Flask's request, whose ``get_json()`` fails as the API does: 400 INVALID_JSON in the error envelope
    (the body is read with the app's JSON provider, ``strict_loads``: depth-capped like every body)."""

    def on_json_loading_failed(self, e: ValueError | None) -> Any:
        if e is None:  # not application/json: Flask's 415
            return super().on_json_loading_failed(e)
        if isinstance(e, JSONTooDeep):
            raise DomainError("INVALID_JSON", TOO_DEEP_MESSAGE) from None
        raise DomainError("INVALID_JSON", f"The request body is not valid JSON: {e}") from None


class ApiBlueprint(flask_smorest.Blueprint):
    ARGUMENTS_PARSER = StrictJSONParser()

    def errors(self, *statuses: int) -> Any:
        """Document error responses with the shared error envelope. An operation that authenticates (401) is also
        rate-limited (429: the client IP's and the key's requests, and the IP's failed authentications)."""
        if 401 in statuses and 429 not in statuses:
            statuses = (*statuses, 429)

        def decorator(func: Any) -> Any:
            for status in statuses:
                func = self.alt_response(
                    status, schema=ErrorEnvelopeSchema, description=_ERROR_DESCRIPTIONS.get(status)
                )(func)
            return func

        return decorator


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return raw_json_response(dumps(body), status, headers)


def raw_json_response(text: str, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    response = current_app.response_class(text, status=status, mimetype="application/json")
    if headers:
        response.headers.update(headers)
    return response


def ok(data: Any, status: int = 200) -> Response:
    return json_response({"success": True, "data": data}, status)
