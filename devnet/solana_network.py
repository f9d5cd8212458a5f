"""Which Solana network the local RPC stands in for: Solana devnet (its genesis hash, its CAIP-2 id)."""

from __future__ import annotations

import hashlib

from devnet.base58 import _B58, b58decode

DEVNET_GENESIS_HASH = "EtWTRABZaYq6iMfeYKouRu166VU2xqa1wcaWoxPkrZBG"
NETWORK = f"solana:{DEVNET_GENESIS_HASH[:32]}"  # CAIP-2: the first 32 characters of the genesis hash
NAME = "Solana Devnet (local)"
_PREFIX = DEVNET_GENESIS_HASH[:32]


def ledger_genesis_hash(seed: bytes) -> str:
    """The genesis hash one local ledger answers: Solana devnet's first 32 characters, so the CAIP-2 id (and
    with it the x402 v1 name and the Wallet Standard chain) stays Solana devnet's, and a tail drawn from
    ``seed``, which a ledger picks when it starts. A ledger started again is a new chain, as a fresh
    ``solana-test-validator`` ledger is (the service tells chains apart by their genesis hash: a merchant's
    account that payments landed in on the old one may be missing on the new one, and is opened again).
    """
    number = int.from_bytes(hashlib.sha256(seed).digest(), "big")
    tail = ""
    for _ in range(len(DEVNET_GENESIS_HASH) - len(_PREFIX)):
        number, digit = divmod(number, 58)
        tail += _B58[digit]
    genesis = _PREFIX + tail
    assert len(b58decode(genesis)) == 32  # the prefix fixes the value far below 2**256 and above 2**248
    return genesis


def is_local_genesis(genesis: object) -> bool:
    """Whether ``genesis`` is one a local ledger answers (see :func:`ledger_genesis_hash`)."""
    return isinstance(genesis, str) and len(genesis) == len(DEVNET_GENESIS_HASH) and genesis.startswith(_PREFIX)
