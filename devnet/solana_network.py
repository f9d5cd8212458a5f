"""Which Solana network the local RPC stands in for: Solana devnet (its genesis hash, its CAIP-2 id)."""

from __future__ import annotations

DEVNET_GENESIS_HASH = "EtWTRABZaYq6iMfeYKouRu166VU2xqa1wcaWoxPkrZBG"
NETWORK = f"solana:{DEVNET_GENESIS_HASH[:32]}"  # CAIP-2: the first 32 characters of the genesis hash
NAME = "Solana Devnet (local)"
