"""Schemas of the public checkout API."""

from __future__ import annotations

from marshmallow import fields, validate

from backend.intents.schemas import PaymentRequirementSchema
from backend.rails.registry import RAILS
from backend.schemas import StrictSchema, envelope
from backend.settlement.schemas import PaymentSignatureSchema


class NativeCurrencySchema(StrictSchema):
    name = fields.String(required=True)
    symbol = fields.String(required=True)
    decimals = fields.Integer(required=True)


class WalletNetworkSchema(StrictSchema):
    network = fields.String(required=True, metadata={"description": "CAIP-2 id, as in payment_requirements"})
    name = fields.String(required=True)
    kind = fields.String(required=True, metadata={"enum": list(RAILS)})  # one per rail
    chain_id = fields.Integer(required=True, allow_none=True, metadata={"description": "EVM chain id"})
    wallet_rpc_url = fields.String(
        required=True, allow_none=True, metadata={"description": "EVM: public RPC offered in wallet_addEthereumChain"}
    )
    native_currency = fields.Nested(NativeCurrencySchema, required=True, allow_none=True)
    wallet_chain = fields.String(
        required=True, allow_none=True, metadata={"description": "Solana: Wallet Standard chain, e.g. solana:devnet"}
    )
    explorer_tx_url = fields.String(
        required=True, allow_none=True, metadata={"description": "Template with {tx} for the transaction's page"}
    )


class CheckoutIntentSchema(StrictSchema):
    intent_id = fields.UUID(required=True)
    status = fields.String(required=True, metadata={"enum": ["pending", "paid", "expired", "cancelled"]})
    merchant_name = fields.String(required=True, allow_none=True)
    description = fields.String(required=True, allow_none=True)
    amount_usdc = fields.Decimal(required=True, metadata={"type": "number"})
    expires_at = fields.String(required=True, metadata={"format": "date-time"})
    redirect_url = fields.String(required=True, allow_none=True)
    cancel_url = fields.String(required=True, allow_none=True)
    payment_requirements = fields.List(fields.Nested(PaymentRequirementSchema), required=True)
    tx_hash = fields.String(required=True, allow_none=True)
    chain = fields.String(required=True, allow_none=True)
    paid_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})
    networks = fields.List(fields.Nested(WalletNetworkSchema), required=True)
    server_time = fields.String(
        required=True, metadata={"format": "date-time", "description": "Now, by the service's clock"}
    )


class BalanceQuerySchema(StrictSchema):
    network = fields.String(required=True, validate=validate.Length(max=64), metadata={"example": "eip155:84532"})
    address = fields.String(
        required=True,
        validate=validate.Length(min=32, max=44),
        metadata={
            "description": "The buyer's address on the network: EVM 0x and 40 hex characters, Solana base58",
            # EVM's exact form; Solana's base58 (a 32-byte key: not every 32-44 character base58 string is one).
            "pattern": "^(0x[0-9a-fA-F]{40}|[1-9A-HJ-NP-Za-km-z]{32,44})$",
        },
    )


class BalanceSchema(StrictSchema):
    network = fields.String(required=True)
    address = fields.String(required=True)
    balance_usdc = fields.Decimal(required=True, metadata={"type": "number"})
    balance_atomic = fields.String(required=True, metadata={"description": "Atomic units (6 decimals)"})
    required_atomic = fields.String(required=True, metadata={"description": "What the intent asks, atomic units"})


class CheckoutPaySchema(StrictSchema):
    payment_signature = fields.Nested(PaymentSignatureSchema, required=True)


CheckoutIntentEnvelope = envelope(CheckoutIntentSchema, "CheckoutIntentResponse")
BalanceEnvelope = envelope(BalanceSchema, "CheckoutBalanceResponse")
