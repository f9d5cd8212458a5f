"""Schemas of the public checkout API."""

from __future__ import annotations

from marshmallow import fields, validate

from backend.chains.addresses import EVM_ADDRESS_PATTERN, EVM_ZERO_ADDRESS, SOLANA_ADDRESS_PATTERN
from backend.intents.schemas import PaymentRequirementSchema
from backend.rails.registry import RAILS
from backend.schemas import StrictSchema, envelope, ref
from backend.settlement.schemas import PaymentSignatureField


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
    network = fields.String(
        required=True,
        validate=validate.Length(max=64),
        metadata={"description": "One of the intent's networks (CAIP-2)", "openapi": ref("Network")},
    )
    address = fields.String(
        required=True,
        validate=validate.Length(min=32, max=44),
        metadata={
            "description": "The buyer's address on the network: EVM 0x and 40 hex characters (not the zero address; "
            "mixed case only with a valid EIP-55 checksum), Solana base58 of a 32-byte key (not the all-zero key)",
            # EVM's exact form (but the checksum), or a base58 string that decodes to 32 bytes.
            "pattern": f"^(?:{EVM_ADDRESS_PATTERN[1:-1]}|{SOLANA_ADDRESS_PATTERN[1:-1]})$",
            "openapi": {"not": {"enum": [EVM_ZERO_ADDRESS]}},
        },
    )


class BalanceSchema(StrictSchema):
    network = fields.String(required=True)
    address = fields.String(required=True)
    balance_usdc = fields.Decimal(required=True, metadata={"type": "number"})
    balance_atomic = fields.String(required=True, metadata={"description": "Atomic units (6 decimals)"})
    required_atomic = fields.String(required=True, metadata={"description": "What the intent asks, atomic units"})


class CheckoutPaySchema(StrictSchema):
    payment_signature = PaymentSignatureField(required=True)


CheckoutIntentEnvelope = envelope(CheckoutIntentSchema, "CheckoutIntentResponse")
BalanceEnvelope = envelope(BalanceSchema, "CheckoutBalanceResponse")
