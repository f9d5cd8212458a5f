"""The facilitator API's bodies as the x402 facilitator spec gives them, for the OpenAPI document. The views read
the request themselves (``services.check``), so that every malformed body gets the spec's answer, not ours; the
request is documented by hand-written components (``facilitator_components``, over settlement's x402 ones)."""

from __future__ import annotations

from typing import Any

from marshmallow import Schema, fields

from backend.chains.addresses import EVM_ADDRESS_PATTERN
from backend.chains.registry import ChainRegistry
from backend.schemas import JSON_VALUE_REF, NO_NUL, ref, text
from backend.settlement.schemas import UINT256, x402_network_names


def facilitator_components(registry: ChainRegistry) -> dict[str, dict[str, Any]]:
    """``POST /verify`` and ``POST /settle``'s body, as the spec gives it and as ``services.check`` reads it: EVM exact
    only. A body that is an object whose paymentPayload and paymentRequirements are objects is read (400 otherwise);
    anything else this document rules out is refused in the spec's way, 200 with isValid or success false."""
    networks = x402_network_names(registry, "evm")
    atomic = {**UINT256, "description": "Atomic units (6 decimals): above 0, at most MAX_AMOUNT_USDC"}
    return {
        "X402PaymentRequirements": {
            "type": "object",
            "description": "The requirement the resource server published (x402 v1 or v2): scheme exact, an EVM "
            "network of this facilitator (GET /supported), its USDC as asset, a wallet of the calling merchant on "
            "that network as payTo, and the amount (amount in v2, maxAmountRequired in v1; either is read)",
            "required": ["scheme", "network", "asset", "payTo"],
            "anyOf": [{"required": ["amount"]}, {"required": ["maxAmountRequired"]}],
            "properties": {
                "scheme": {"type": "string", "enum": ["exact"]},
                "network": {"type": "string", "enum": networks, "description": "A CAIP-2 id or an x402 v1 name"},
                "amount": atomic,
                "maxAmountRequired": atomic,
                "asset": {"type": "string", "pattern": EVM_ADDRESS_PATTERN},
                "payTo": {"type": "string", "pattern": EVM_ADDRESS_PATTERN},
                "resource": text(type="string", description="v1: the resource's URL (recorded, 2048 characters)"),
                "description": text(type="string", description="v1: recorded as the intent's (500 characters)"),
                "mimeType": text(type="string"),
                "maxTimeoutSeconds": {"type": "integer", "minimum": 0},
                "extra": {"type": "object", "propertyNames": text(), "additionalProperties": JSON_VALUE_REF},
            },
            "propertyNames": {"pattern": NO_NUL},
            "additionalProperties": JSON_VALUE_REF,
        },
        "X402FacilitatorRequest": {
            "type": "object",
            "description": "What the resource server's buyer sent (paymentPayload, as its X-PAYMENT or "
            "PAYMENT-SIGNATURE header carried it) and what it asked for (paymentRequirements)",
            "required": ["paymentPayload", "paymentRequirements"],
            "properties": {
                "x402Version": {
                    "type": "integer",
                    "enum": [1, 2],
                    "description": "paymentPayload's (the default); another value is refused with the spec's "
                    "invalid_x402_version",
                },
                "paymentPayload": {"oneOf": [ref("X402PaymentV1Evm"), ref("X402PaymentV2Evm")]},
                "paymentRequirements": ref("X402PaymentRequirements"),
            },
            "propertyNames": {"pattern": NO_NUL},
            "additionalProperties": JSON_VALUE_REF,
        },
    }


class SupportedKindSchema(Schema):
    x402Version = fields.Integer(required=True)
    scheme = fields.String(required=True, metadata={"enum": ["exact"]})
    network = fields.String(required=True, metadata={"example": "eip155:84532"})
    extra = fields.Dict(
        metadata={
            "description": "Ours: the requirement's fields that do not depend on the resource (payTo, asset, "
            "maxTimeoutSeconds, usdcDomainName, extra with the token's EIP-712 name and version)"
        }
    )


class SupportedSchema(Schema):
    kinds = fields.List(fields.Nested(SupportedKindSchema), required=True)
    extensions = fields.List(fields.String(), required=True, metadata={"example": ["payment-identifier"]})
    signers = fields.Dict(required=True, metadata={"description": "Empty: the relay's addresses are not published"})


class _FailureSchema(Schema):
    code = fields.String(required=True, metadata={"description": "Our error code (the error catalog's, upper case)"})
    message = fields.String(required=True)


class VerifyResponseSchema(Schema):
    isValid = fields.Boolean(required=True)
    invalidReason = fields.String(metadata={"description": "The spec's reason, when isValid is false"})
    invalidMessage = fields.String()
    payer = fields.String()
    error = fields.Nested(_FailureSchema, metadata={"description": "When isValid is false: our code and message"})


class SettleResponseSchema(Schema):
    success = fields.Boolean(required=True)
    errorReason = fields.String(metadata={"description": "The spec's reason, when success is false"})
    errorMessage = fields.String()
    payer = fields.String()
    transaction = fields.String(required=True, metadata={"description": "The transaction hash ('' if none)"})
    network = fields.String(required=True, metadata={"description": "As paymentRequirements.network was sent"})
    amount = fields.String(metadata={"description": "Atomic units settled"})
    error = fields.Nested(_FailureSchema, metadata={"description": "When success is false: our code and message"})
