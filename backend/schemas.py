"""Marshmallow fields and envelopes shared by every domain's API schemas."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from marshmallow import Schema, ValidationError, fields, validate

from backend import appstate
from backend.errors import echo
from backend.money import AmountError, parse_usdc_amount

METADATA_MAX_KEYS = 50
METADATA_MAX_KEY_LENGTH = 40
METADATA_MAX_VALUE_LENGTH = 500


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
        super().__init__(schemes={"http", "https"}, require_tld=False, **kwargs)

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, str) and len(value) > 2048:
            raise ValidationError("must be at most 2048 characters")
        return super()._deserialize(value, attr, data, **kwargs)


class FlatMetadata(fields.Dict):
    """A flat object of at most 50 keys; values are strings, numbers, booleans or null."""

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
