"""Marshmallow fields and envelopes shared by every domain's API schemas."""

from __future__ import annotations

from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from marshmallow import Schema, ValidationError, fields, validate

from backend import appstate
from backend.errors import echo
from backend.money import AmountError, parse_usdc_amount

METADATA_MAX_KEYS = 50
METADATA_MAX_KEY_LENGTH = 40
METADATA_MAX_VALUE_LENGTH = 500
HTTP_URL_MAX_LENGTH = 2048

# The OpenAPI document (docs/architecture.md, "The OpenAPI document"): every request string the API reads is
# documented with a pattern, this one at least (a JSON body with a NUL in any string or key is 400 INVALID_JSON,
# a path or query with one 400 INVALID_REQUEST).
NO_NUL = "^[^\\u0000]*$"
JSON_VALUE = "JsonValue"  # the component: any JSON value without a NUL in its strings and keys
JSON_VALUE_REF = {"$ref": "#/components/schemas/" + JSON_VALUE}
JSON_VALUE_SCHEMA: dict[str, Any] = {
    "description": "Any JSON value (nested at most 32 levels deep) without a NUL character in a string or a key",
    "anyOf": [
        {"type": "string", "pattern": NO_NUL},
        {"type": ["number", "boolean", "null"]},
        {"type": "array", "items": JSON_VALUE_REF},
        {"type": "object", "propertyNames": {"pattern": NO_NUL}, "additionalProperties": JSON_VALUE_REF},
    ],
}
# A URL as HttpUrl reads it (marshmallow's URL check, schemes http and https, a valid port; a webhook's without
# credentials), in ASCII: the scheme, userinfo if allowed, a host (a dotless name; a name of at most 7 labels with a
# top one of 2 or more characters; IPv4), a port up to 65535, then nothing, "/", or one of /?# and no space (Python's
# whitespace). Bracketed IPv6 hosts are read too, and names of longer labels: the pattern leaves them out.
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,30}[A-Za-z0-9])?"
_HOST = (
    f"{_LABEL}\\.?|(?:{_LABEL}\\.){{1,6}}[A-Za-z0-9][A-Za-z0-9-]{{0,30}}[A-Za-z0-9]\\.?"
    "|[0-9]{1,3}(?:\\.[0-9]{1,3}){3}"
)
_PORT = "(?::0{0,4}(?:[0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?"
_NOT_SPACE = "[^\\u0000\\t-\\r\\u001c-\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]"


def http_url_pattern(userinfo: bool = True) -> str:
    credentials = "(?:(?:[A-Za-z0-9._~!$&'()*+,;=:-]|%[0-9A-Fa-f]{2})*@)?" if userinfo else ""
    return f"^[Hh][Tt][Tt][Pp][Ss]?://{credentials}(?:{_HOST}){_PORT}(?:/?|[/?#]{_NOT_SPACE}+)$"


def openapi_override(self: Any, field: fields.Field[Any], ret: dict[str, Any], **_: Any) -> dict[str, Any]:
    """An apispec attribute function (run last): a field's ``metadata["openapi"]`` replaces what the converter
    derived for it, key by key (``None`` removes a key; a ``$ref`` keeps only the description beside it). For what
    marshmallow cannot say: propertyNames of free-form objects, references to the hand-written components."""
    override = field.metadata.get("openapi") or {}
    if "$ref" in override:
        for key in [key for key in ret if key != "description"]:
            del ret[key]
    for key, value in override.items():
        if value is None:
            ret.pop(key, None)
    return {key: value for key, value in override.items() if value is not None}


def ref(component: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{component}"}


def text(**metadata: Any) -> dict[str, Any]:
    """A string field's metadata with the NUL-free pattern (unless the field gives a stricter one)."""
    return {"pattern": NO_NUL, **metadata}


class StrictSchema(Schema):
    """Unknown fields are refused with a clear message rather than silently dropped."""

    class Meta:
        unknown = "raise"


class UsdcAmount(fields.Field[Decimal]):
    """A USDC amount: a JSON number > 0 with at most 6 decimals (see backend.money)."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> Decimal:
        try:
            return parse_usdc_amount(value, maximum=appstate.settings().max_amount_usdc)
        except AmountError as exc:
            raise ValidationError(str(exc)) from None

    def _serialize(self, value: Any, attr: str | None, obj: Any, **kwargs: Any) -> Any:
        return value


class HttpUrl(fields.Url):
    def __init__(self, **kwargs: Any) -> None:
        documented = {"pattern": http_url_pattern(), "maxLength": HTTP_URL_MAX_LENGTH}
        kwargs["metadata"] = {**documented, **kwargs.get("metadata", {})}
        super().__init__(schemes={"http", "https"}, require_tld=False, **kwargs)

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, str) and len(value) > HTTP_URL_MAX_LENGTH:
            raise ValidationError(f"must be at most {HTTP_URL_MAX_LENGTH} characters")
        url = super()._deserialize(value, attr, data, **kwargs)
        try:  # what the regex lets through that urllib cannot read: a bracketed host that is no IP, a port > 65535
            urlsplit(url).port  # noqa: B018
        except ValueError:
            raise ValidationError(self.error_messages["invalid"]) from None
        return url


class FlatMetadata(fields.Dict):
    """A flat object of at most 50 keys; values are strings, numbers, booleans or null."""

    def __init__(self, **kwargs: Any) -> None:
        documented = {
            "maxProperties": METADATA_MAX_KEYS,
            "propertyNames": {"minLength": 1, "maxLength": METADATA_MAX_KEY_LENGTH, "pattern": NO_NUL},
            "additionalProperties": {
                "anyOf": [
                    {"type": "string", "maxLength": METADATA_MAX_VALUE_LENGTH, "pattern": NO_NUL},
                    {"type": ["number", "boolean", "null"]},
                ]
            },
        }
        metadata = kwargs.get("metadata", {})
        kwargs["metadata"] = {**metadata, "openapi": {**documented, **metadata.get("openapi", {})}}
        super().__init__(**kwargs)

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ValidationError("must be an object of key-value pairs")
        if len(value) > METADATA_MAX_KEYS:
            raise ValidationError(f"must have at most {METADATA_MAX_KEYS} keys")
        for key, item in value.items():
            if not key or len(key) > METADATA_MAX_KEY_LENGTH:
                raise ValidationError(f"keys must be 1 to {METADATA_MAX_KEY_LENGTH} characters")
            if isinstance(item, dict | list):
                raise ValidationError(f"value of {echo(key)} must be a string, number, boolean or null, not nested")
            if isinstance(item, str) and len(item) > METADATA_MAX_VALUE_LENGTH:
                raise ValidationError(f"value of {echo(key)} must be at most {METADATA_MAX_VALUE_LENGTH} characters")
            if isinstance(item, Decimal) and not item.is_finite():
                raise ValidationError(f"value of {echo(key)} must be a finite number")
        return dict(value)


class ErrorDetailSchema(Schema):
    code = fields.String(required=True, metadata={"description": "Stable UPPER_SNAKE error code"})
    message = fields.String(required=True, metadata={"description": "Human-readable explanation"})
    fields_ = fields.Dict(data_key="fields", metadata={"description": "Per-field messages (VALIDATION_ERROR only)"})

    class Meta:
        unknown = "include"


class ErrorEnvelopeSchema(Schema):
    success = fields.Boolean(required=True, metadata={"enum": [False]})
    error = fields.Nested(ErrorDetailSchema, required=True)


def envelope(data_schema: type[Schema] | Schema, name: str) -> type[Schema]:
    """``{success: true, data: <schema>}`` as a named schema for the OpenAPI document."""
    return Schema.from_dict(
        {
            "success": fields.Boolean(required=True, metadata={"enum": [True]}),
            "data": fields.Nested(data_schema, required=True),
        },
        name=name,
    )


class PageQuerySchema(StrictSchema):
    """``limit`` (default 20, at most 100) and ``offset`` (default 0) of every list endpoint."""

    limit = fields.Integer(
        load_default=20, validate=validate.Range(min=1, max=100), metadata={"description": "Page size (1-100)"}
    )
    offset = fields.Integer(load_default=0, validate=validate.Range(min=0, max=10_000_000))


def page_of(item_schema: type[Schema], items_key: str, name: str) -> type[Schema]:
    """``{<items_key>: [item], total, limit, offset}`` as a named schema for the OpenAPI document."""
    return Schema.from_dict(
        {
            items_key: fields.List(fields.Nested(item_schema), required=True),
            "total": fields.Integer(required=True),
            "limit": fields.Integer(required=True),
            "offset": fields.Integer(required=True),
        },
        name=name,
    )
