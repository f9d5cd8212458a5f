"""The facilitator API's bodies as the x402 facilitator spec gives them, for the OpenAPI document. The views read
the request themselves (``services.check``), so that every malformed body gets the spec's answer, not ours."""

from __future__ import annotations

from marshmallow import INCLUDE, Schema, fields


class FacilitatorRequestSchema(Schema):
    """``POST /verify`` and ``POST /settle``: what the resource server's buyer sent and what it asked for."""

    class Meta:
        unknown = INCLUDE

    x402Version = fields.Raw(
        metadata={
            "description": "1 or 2 (default: paymentPayload's); another value is answered 200 with the spec's "
            "invalid_x402_version, as every refusal of the payment is"
        }
    )
    paymentPayload = fields.Dict(
        required=True,
        metadata={
            "description": "The buyer's PaymentPayload as its X-PAYMENT / PAYMENT-SIGNATURE header carried it (v1: "
            "scheme, network, payload; v2: accepted, payload, resource, extensions). EVM exact only"
        },
    )
    paymentRequirements = fields.Dict(
        required=True,
        metadata={
            "description": "The requirement the resource server published: scheme exact, network (CAIP-2 or v1 "
            "name), amount (v2) or maxAmountRequired (v1) in atomic units, asset (the network's USDC), payTo (a "
            "wallet of the calling merchant on that network), maxTimeoutSeconds, extra"
        },
    )


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
