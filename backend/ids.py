"""Identifiers and secrets. Random values come from ``secrets`` only."""

from __future__ import annotations

import secrets
import uuid

BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def base62_secret(nbytes: int = 32) -> str:
    """A base62 string carrying at least ``nbytes`` random bytes of entropy."""
    value = int.from_bytes(secrets.token_bytes(nbytes), "big")
    # 43 base62 digits hold 256 bits; pad so every secret has the same length.
    length = -(-nbytes * 8 * 1000 // 5954)  # ceil(bits / log2(62)), log2(62) ~ 5.954
    out = []
    for _ in range(length):
        value, rem = divmod(value, 62)
        out.append(BASE62[rem])
    return "".join(out)


def prefixed_id(prefix: str) -> str:
    """A Stripe-style object id such as ``mer_3f2a...`` (prefix + 32 hex chars of a UUID4)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def intent_id() -> str:
    """Payment intents are identified by a canonical UUID4 string, as the spec says."""
    return str(uuid.uuid4())
