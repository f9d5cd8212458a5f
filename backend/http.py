"""HTTP plumbing shared by the API views: strict JSON parsing, JSON responses, error docs."""

from __future__ import annotations

from typing import Any

import flask_smorest
from flask import Response, current_app
from marshmallow import EXCLUDE
from webargs.flaskparser import FlaskParser, is_json_request

from backend.errors import APIError
from backend.jsonio import JSONParseError, dumps, strict_loads
from backend.schemas import ErrorEnvelopeSchema

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
}


class StrictJSONParser(FlaskParser):
    """webargs parser that reads bodies with the service's exact JSON rules."""

    DEFAULT_VALIDATION_STATUS = 400  # the error handler turns it into VALIDATION_ERROR
    # Unknown body fields and query parameters are refused alike (schemas say RAISE).
    DEFAULT_UNKNOWN_BY_LOCATION = {"headers": EXCLUDE, "cookies": EXCLUDE}

    def _raw_load_json(self, req: Any) -> Any:
        body = req.get_data(cache=True)
        if not is_json_request(req):
            if body:
                raise APIError(415, "UNSUPPORTED_MEDIA_TYPE", "Send the body as Content-Type: application/json")
            return super()._raw_load_json(req)
        if not body:
            raise APIError(400, "INVALID_JSON", "The request body is empty; send a JSON object")
        try:
            data = strict_loads(body)
        except JSONParseError as exc:
            raise APIError(400, "INVALID_JSON", f"The request body is not valid JSON: {exc}") from None
        if _has_nul(data):
            raise APIError(400, "INVALID_JSON", "Strings must not contain the NUL character (\\u0000)")
        return data


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


class ApiBlueprint(flask_smorest.Blueprint):
    ARGUMENTS_PARSER = StrictJSONParser()

    def errors(self, *statuses: int) -> Any:
        """Document error responses with the shared error envelope."""

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
