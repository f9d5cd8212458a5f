"""JSON in and out, with money kept exact.

Requests are parsed with numbers as ``Decimal`` (never ``float``), the non-standard
constants ``NaN``/``Infinity`` refused, and so is text nested deeper than
``payintent.jsonlimits.MAX_JSON_DEPTH`` (checked before parsing, without recursion) and text with a
lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no character, so it cannot be written as UTF-8 to
the database, a log line or a webhook body; a correctly paired one is the character it encodes). Responses
are written with ``Decimal`` values as JSON numbers, digit for digit, so ``amount_usdc``
round-trips exactly.
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Any

import simplejson
from flask.json.provider import JSONProvider
from werkzeug.sansio.response import Response

from backend.clock import isoformat
from payintent.jsonlimits import MAX_JSON_DEPTH, LoneSurrogate, exceeds_depth, has_lone_surrogate


class JSONParseError(ValueError):
    """The body is not the strict JSON we accept."""


class JSONTooDeep(JSONParseError):
    """The text nests arrays and objects deeper than the cap."""


def _reject_constant(name: str) -> Any:
    raise JSONParseError(f"{name} is not valid JSON")


def strict_loads(data: str | bytes, *, max_depth: int | None = MAX_JSON_DEPTH) -> Any:
    """Parse JSON; numbers with a fraction or exponent become ``Decimal``. Text nested deeper than
    ``max_depth`` raises :class:`JSONTooDeep` before it is parsed (``None``: our own stored rows)."""
    if max_depth is not None and exceeds_depth(data, max_depth):
        raise JSONTooDeep(f"arrays and objects nested deeper than {max_depth} levels")
    try:
        if isinstance(data, bytes):
            data = data.decode("utf-8")  # raw surrogate bytes are not UTF-8: refused here
        value = json.loads(data, parse_float=Decimal, parse_constant=_reject_constant)
    except JSONParseError:
        raise
    except (ValueError, RecursionError) as exc:  # includes JSONDecodeError, UnicodeDecodeError
        raise JSONParseError(str(exc).split(":")[0] or "invalid JSON") from None
    if has_lone_surrogate(data, value):
        raise JSONParseError(str(LoneSurrogate()))
    return value


def stored_loads(data: str | bytes) -> Any:
    """:func:`strict_loads` for JSON columns: rows we wrote, some before the depth cap existed. Still no
    crash on a deep one: with the recursion limit restored (payintent.jsonlimits) the parser raises."""
    return strict_loads(data, max_depth=None)


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return isoformat(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The usual call's encoder, made once (simplejson builds a new one for every call with options: a third of a
# small answer's time). Its settings only are kept on it, so threads share it safely.
_COMPACT = simplejson.JSONEncoder(separators=(",", ":"), use_decimal=True, default=_default)


def dumps(value: Any, **kwargs: Any) -> str:
    if not kwargs:
        return _COMPACT.encode(value)
    kwargs.setdefault("separators", (",", ":"))
    return simplejson.dumps(value, use_decimal=True, default=_default, **kwargs)


class ExactJSONProvider(JSONProvider):
    """Flask JSON provider built on :func:`dumps` and :func:`strict_loads`."""

    mimetype = "application/json"

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        kwargs.pop("sort_keys", None)
        return dumps(obj, **kwargs)

    def loads(self, s: str | bytes, **kwargs: Any) -> Any:
        return strict_loads(s)

    def response(self, *args: Any, **kwargs: Any) -> Response:
        obj = self._prepare_response_obj(args, kwargs)
        return self._app.response_class(self.dumps(obj), mimetype=self.mimetype)
