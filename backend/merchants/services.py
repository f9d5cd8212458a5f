"""Merchant accounts, API keys and wallets: plain functions used by the CLI, API and dashboard."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import IntegrityError

from backend import clock, passwords
from backend.chains.addresses import AddressError
from backend.chains.registry import ChainRegistry
from backend.errors import DomainError, echo
from backend.extensions import db
from backend.ids import base62_secret
from backend.merchants.models import ApiKey, Merchant, Wallet
from backend.rails.base import Rail
from backend.rails.registry import rail_for

KEY_PREFIX = "sk_test_"
KEY_DISPLAY_CHARS = 6  # characters after the prefix shown in listings
# last_used_at is written at most once per this interval per key, so reads stay read-only.
LAST_USED_PRECISION = timedelta(seconds=60)
_EMAIL_RE = re.compile(r"^[^@\s]{1,64}@[^@\s]+\.[^@\s]+$")
MIN_PASSWORD_LENGTH = 8
_hasher = PasswordHasher()


class MerchantError(DomainError, ValueError):
    """Bad input for a merchant operation; the message is safe to show (a catalog code: backend.errors)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)


@dataclass(frozen=True)
class IssuedKey:
    key: ApiKey
    secret: str  # shown once, never stored


def hash_api_key(secret: str) -> str:
    # The key carries 256 random bits, so a fast hash is safe: nobody can brute-force it.
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def hash_password(password: str) -> str:
    """argon2, in one of the machine's password-hash slots (``passwords.PasswordCheckBusy`` when none frees up)."""
    with passwords.slot():
        return _hasher.hash(password)


def verify_password(password_hash: str, password: str) -> bool:
    """Like :func:`hash_password`, in a slot: raises ``passwords.PasswordCheckBusy`` rather than wait long."""
    with passwords.slot():
        try:
            return _hasher.verify(password_hash, password)
        except (VerificationError, InvalidHashError):
            return False


def create_merchant(email: str, password: str, name: str | None = None) -> tuple[Merchant, IssuedKey]:
    """Create a merchant with a first API key. Commits."""
    email = (email or "").strip().lower()
    if not _EMAIL_RE.match(email) or len(email) > 254:
        raise MerchantError("INVALID_EMAIL", "email must be a valid address like shop@example.com")
    if not isinstance(password, str) or len(password) < MIN_PASSWORD_LENGTH:
        raise MerchantError("WEAK_PASSWORD", f"password must be at least {MIN_PASSWORD_LENGTH} characters")
    if len(password) > 1024:
        raise MerchantError("INVALID_PASSWORD", "password must be at most 1024 characters")
    name = (name or "").strip() or email.split("@", 1)[0]
    if len(name) > 200:
        raise MerchantError("INVALID_NAME", "name must be at most 200 characters")
    if db.session.scalar(select(Merchant.id).where(Merchant.email == email)):
        raise MerchantError("EMAIL_TAKEN", f"a merchant with email {email} already exists")
    merchant = Merchant(email=email, name=name, password_hash=hash_password(password))
    db.session.add(merchant)
    try:
        db.session.flush()
    except IntegrityError:
        db.session.rollback()
        raise MerchantError("EMAIL_TAKEN", f"a merchant with email {email} already exists") from None
    issued = _new_key(merchant.id)
    db.session.commit()
    return merchant, issued


def get_merchant(merchant_id: str) -> Merchant:
    merchant = db.session.get(Merchant, merchant_id) if isinstance(merchant_id, str) else None
    if merchant is None:
        raise MerchantError("MERCHANT_NOT_FOUND", f"no merchant with id {merchant_id}")
    return merchant


def _new_key(merchant_id: str) -> IssuedKey:
    secret = KEY_PREFIX + base62_secret(32)
    key = ApiKey(
        merchant_id=merchant_id,
        key_hash=hash_api_key(secret),
        display_prefix=secret[: len(KEY_PREFIX) + KEY_DISPLAY_CHARS],
    )
    db.session.add(key)
    db.session.flush()
    return IssuedKey(key=key, secret=secret)


def create_api_key(merchant_id: str) -> IssuedKey:
    """Issue a new key for the merchant. Commits; the secret is only in the return value."""
    get_merchant(merchant_id)
    issued = _new_key(merchant_id)
    db.session.commit()
    return issued


def revoke_api_key(merchant_id: str, key_id: str) -> ApiKey:
    """Revoke a key at once. Revoking twice is harmless. Commits."""
    get_merchant(merchant_id)
    key = db.session.get(ApiKey, key_id) if isinstance(key_id, str) else None
    if key is None or key.merchant_id != merchant_id:
        raise MerchantError("KEY_NOT_FOUND", f"merchant {merchant_id} has no key {key_id}")
    if key.revoked_at is None:
        key.revoked_at = clock.now()
        db.session.commit()
    return key


def list_api_keys(merchant_id: str) -> list[ApiKey]:
    return list(
        db.session.scalars(select(ApiKey).where(ApiKey.merchant_id == merchant_id).order_by(ApiKey.created_at.desc()))
    )


_keys = ApiKey.__table__
# Built once: these run on every API request. KEY_COLUMNS and ACTIVE_KEY let a hot path read the key in the
# statement that reads what the request wants (backend.intents.services), then check it with accept_key.
KEY_COLUMNS = (
    _keys.c.id.label("api_key_id"), _keys.c.merchant_id.label("api_key_merchant_id"),
    _keys.c.key_hash.label("api_key_hash"), _keys.c.last_used_at.label("api_key_last_used_at"),
)  # fmt: skip
ACTIVE_KEY = (_keys.c.key_hash == bindparam("key_hash")) & _keys.c.revoked_at.is_(None)
_ACTIVE_KEY = select(*KEY_COLUMNS).where(ACTIVE_KEY)
_TOUCH_KEY = update(_keys).where(_keys.c.id == bindparam("key_id")).values(last_used_at=bindparam("now"))


def api_key_digest(secret: str) -> str | None:
    """What ACTIVE_KEY's ``key_hash`` parameter is for ``secret``; None when it cannot be a key."""
    if not secret.startswith(KEY_PREFIX) or len(secret) > 128:
        return None
    return hash_api_key(secret)


def accept_key(row: Mapping[Any, Any] | None, digest: str, execute: Callable[..., Any]) -> str | None:
    """The merchant id of the active key a row of KEY_COLUMNS (None: no row) holds, or None. Touches
    ``last_used_at`` (at most once per LAST_USED_PRECISION) with ``execute`` (a session's, then committed, or an
    autocommit connection's)."""
    if row is None or not hmac.compare_digest(row["api_key_hash"], digest):
        return None
    now = clock.now()
    last_used_at = row["api_key_last_used_at"]
    if last_used_at is None or now - last_used_at >= LAST_USED_PRECISION:
        execute(_TOUCH_KEY, {"key_id": row["api_key_id"], "now": now})
    return str(row["api_key_merchant_id"])


def authenticate(secret: str) -> str | None:
    """Return the merchant id owning an active key, or ``None``. Touches ``last_used_at``."""
    digest = api_key_digest(secret)
    if digest is None:
        return None
    row = db.session.execute(_ACTIVE_KEY, {"key_hash": digest}).mappings().first()

    def touch(statement: Any, params: dict[str, Any]) -> None:
        db.session.execute(statement, params)
        db.session.commit()

    return accept_key(row, digest, touch)


def set_wallet(
    merchant_id: str, network_id: str, address: str, registry: ChainRegistry, *, verified: bool = False
) -> Wallet:
    """Register or replace the merchant's wallet on a network. Commits.

    Intents created afterwards pay the new address; existing intents keep the requirements
    they were created with. ``verified``: the wallet just signed the service's message (``merchants.proofs``);
    otherwise a new address is unverified, and the same address keeps whatever proof it had.
    """
    get_merchant(merchant_id)
    network = registry.get(network_id)
    if network is None:
        known = ", ".join(registry.ids())
        raise MerchantError("UNKNOWN_NETWORK", f"network {echo(network_id)} is not configured; known: {known}")
    rail = rail_for(network)
    try:
        normalized = rail.normalize_address(address)
    except AddressError as exc:
        raise MerchantError("INVALID_ADDRESS", f"address {exc}") from None
    reserved = service_addresses(registry, rail).get(normalized)
    if reserved:
        raise MerchantError("ADDRESS_NOT_ALLOWED", f"address {normalized} is {reserved}, not a wallet that can be paid")
    wallet = db.session.scalar(select(Wallet).where(Wallet.merchant_id == merchant_id, Wallet.network == network_id))
    if wallet is None:
        wallet = Wallet(merchant_id=merchant_id, network=network_id, address=normalized)
        db.session.add(wallet)
    elif wallet.address != normalized:
        wallet.address = normalized
        wallet.verified_at = None
    if verified:
        wallet.verified_at = clock.now()
    db.session.commit()
    return wallet


def service_addresses(registry: ChainRegistry, rail: Rail) -> dict[str, str]:
    """Addresses of networks of ``rail``'s kind that are the service's or the asset's, never a merchant's wallet, with
    what each is: the USDC contract (EVM) or mint (Solana), the relay accounts (EVM ``relay_addresses``, the
    Solana ``fee_payer``), and on Solana the programs a payment calls. Across every configured network of that
    kind: a relay key or token address is often the same on several chains.

    A payout to the relay would let a merchant pay itself from its own buyers' payments into the relay's
    account (and, on Solana, make the relay appear in the payment), and a payout to the token contract or mint
    sends USDC where nobody can take it out.
    """
    reserved = rail.reserved_addresses()  # Solana: the programs a payment calls
    for network in registry:
        if rail_for(network).kind != rail.kind:  # by kind: whichever instance of the rail was passed
            continue
        reserved[network.usdc_address] = f"the USDC {rail.asset_noun} on {network.name}"
        for relay in (*network.relay_addresses, *([network.fee_payer] if network.fee_payer else [])):
            try:
                reserved[rail.normalize_address(relay)] = f"a relay account of this service on {network.name}"
            except AddressError:
                continue
    return reserved


def remove_wallet(merchant_id: str, network_id: str) -> None:
    wallet = db.session.scalar(select(Wallet).where(Wallet.merchant_id == merchant_id, Wallet.network == network_id))
    if wallet is None:
        raise MerchantError("WALLET_NOT_FOUND", f"no wallet on {echo(network_id)}")
    db.session.delete(wallet)
    db.session.commit()


def list_wallets(merchant_id: str) -> list[Wallet]:
    return list(db.session.scalars(select(Wallet).where(Wallet.merchant_id == merchant_id).order_by(Wallet.network)))
