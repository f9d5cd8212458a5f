"""Read SPL Token accounts and mints from raw account data, as a Solana RPC node presents them.

Layouts (SPL Token and the base of Token-2022): a mint is 82 bytes (``mint_authority`` COption,
``supply`` u64, ``decimals`` u8, ``is_initialized`` bool, ``freeze_authority`` COption); a token
account is 165 bytes (``mint``, ``owner``, ``amount`` u64, ``delegate`` COption, ``state`` u8,
``is_native`` COption<u64>, ``delegated_amount`` u64, ``close_authority`` COption). Token-2022
accounts may carry extensions after byte 165, marked by an account-type byte (1 mint, 2 account).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from solders.pubkey import Pubkey

TOKEN_PROGRAM = Pubkey.from_string("TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA")
TOKEN_2022_PROGRAM = Pubkey.from_string("TokenzQdBNbLqP5VEhdkAS6EPFLC1PHnBqCXEpPxuEb")
TOKEN_PROGRAMS = {TOKEN_PROGRAM: "spl-token", TOKEN_2022_PROGRAM: "spl-token-2022"}
MINT_LEN = 82
ACCOUNT_LEN = 165
_ACCOUNT_TYPE_MINT = 1
_ACCOUNT_TYPE_ACCOUNT = 2
_STATES = {1: "initialized", 2: "frozen"}


@dataclass(frozen=True)
class Mint:
    mint_authority: Pubkey | None
    supply: int
    decimals: int
    is_initialized: bool
    freeze_authority: Pubkey | None


@dataclass(frozen=True)
class TokenAccount:
    mint: Pubkey
    owner: Pubkey
    amount: int
    delegate: Pubkey | None
    state: int  # 0 uninitialized, 1 initialized, 2 frozen
    native_reserve: int | None
    delegated_amount: int
    close_authority: Pubkey | None


def _coption_key(data: bytes, offset: int) -> Pubkey | None:
    (tag,) = struct.unpack_from("<I", data, offset)
    return Pubkey.from_bytes(data[offset + 4 : offset + 36]) if tag == 1 else None


def parse_mint(owner: Pubkey, data: bytes) -> Mint | None:
    """The mint in ``data`` if it is an initialized mint of a token program, else None."""
    if owner not in TOKEN_PROGRAMS or len(data) < MINT_LEN:
        return None
    if len(data) > MINT_LEN and (owner != TOKEN_2022_PROGRAM or data[ACCOUNT_LEN] != _ACCOUNT_TYPE_MINT):
        return None
    (supply,) = struct.unpack_from("<Q", data, 36)
    mint = Mint(_coption_key(data, 0), supply, data[44], data[45] == 1, _coption_key(data, 46))
    return mint if mint.is_initialized else None


def parse_token_account(owner: Pubkey, data: bytes) -> TokenAccount | None:
    """The token account in ``data`` if it is an initialized account of a token program, else None."""
    if owner not in TOKEN_PROGRAMS or len(data) < ACCOUNT_LEN:
        return None
    if len(data) > ACCOUNT_LEN and (owner != TOKEN_2022_PROGRAM or data[ACCOUNT_LEN] != _ACCOUNT_TYPE_ACCOUNT):
        return None
    state = data[108]
    if state not in _STATES:
        return None
    (amount,) = struct.unpack_from("<Q", data, 64)
    (native_tag, native_reserve) = struct.unpack_from("<IQ", data, 109)
    (delegated_amount,) = struct.unpack_from("<Q", data, 121)
    return TokenAccount(
        mint=Pubkey.from_bytes(data[0:32]),
        owner=Pubkey.from_bytes(data[32:64]),
        amount=amount,
        delegate=_coption_key(data, 72),
        state=state,
        native_reserve=native_reserve if native_tag == 1 else None,
        delegated_amount=delegated_amount,
        close_authority=_coption_key(data, 129),
    )


def ui_token_amount(amount: int, decimals: int) -> dict[str, Any]:
    """``{amount, decimals, uiAmount, uiAmountString}`` as the node writes it (``uiAmountString`` trimmed)."""
    text = format(Decimal(amount).scaleb(-decimals), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return {
        "amount": str(amount),
        "decimals": decimals,
        "uiAmount": amount / 10**decimals,
        "uiAmountString": text,
    }


def parsed_account_data(owner: Pubkey, data: bytes, decimals_of: Any) -> dict[str, Any] | None:
    """The ``jsonParsed`` form of a mint or token account (None: not one; the caller falls back to base64).

    ``decimals_of(mint) -> int | None`` looks up a mint's decimals for a token account.
    """
    program = TOKEN_PROGRAMS.get(owner)
    if program is None:
        return None
    mint = parse_mint(owner, data)
    if mint is not None:
        info: dict[str, Any] = {
            "decimals": mint.decimals,
            "freezeAuthority": str(mint.freeze_authority) if mint.freeze_authority else None,
            "isInitialized": True,
            "mintAuthority": str(mint.mint_authority) if mint.mint_authority else None,
            "supply": str(mint.supply),
        }
        return {"parsed": {"info": info, "type": "mint"}, "program": program, "space": len(data)}
    account = parse_token_account(owner, data)
    if account is None:
        return None
    decimals = decimals_of(account.mint)
    if decimals is None:
        return None
    info = {
        "isNative": account.native_reserve is not None,
        "mint": str(account.mint),
        "owner": str(account.owner),
        "state": _STATES[account.state],
        "tokenAmount": ui_token_amount(account.amount, decimals),
    }
    if account.delegate is not None:
        info["delegate"] = str(account.delegate)
        info["delegatedAmount"] = ui_token_amount(account.delegated_amount, decimals)
    if account.native_reserve is not None:
        info["rentExemptReserve"] = ui_token_amount(account.native_reserve, decimals)
    if account.close_authority is not None:
        info["closeAuthority"] = str(account.close_authority)
    return {"parsed": {"info": info, "type": "account"}, "program": program, "space": len(data)}
