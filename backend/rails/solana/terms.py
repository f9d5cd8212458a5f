"""The Solana rail's typed terms (apart from ``rail.py`` so its relay and finish-from-chain modules read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SolanaTerms:
    """A checked buyer-signed transaction, in the settlement row's terms."""

    payer: str
    pay_to: str
    value: int
    # A block height past which its blockhash surely expired (generous upper bound; 0 until ``check_on_chain``).
    last_valid_block_height: int
    nonce_hex: str  # sha256 of the signed message: one settlement per transaction
    transaction: str  # the buyer-signed transaction, base64 (the relay co-signs it as fee payer)
    # It opens the merchant's USDC account (the buyer funds the rent). Known when /pay parses the transaction;
    # terms read back from a row leave it False (the relayer checks the transaction again before co-signing).
    creates_payee_account: bool = False
