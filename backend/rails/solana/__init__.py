"""The Solana rail (buyer-signed SPL transfers, relay as fee payer): ``rail``."""
