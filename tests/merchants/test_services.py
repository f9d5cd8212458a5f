"""Merchants, keys and wallets as plain functions."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import select

from backend.extensions import db
from backend.merchants import services
from backend.merchants.models import ApiKey, Merchant, Wallet
from backend.merchants.services import MerchantError


def test_key_is_shown_once_and_stored_only_as_a_hash(app):
    merchant, issued = services.create_merchant("Shop@Example.com", "long enough password")
    assert re.fullmatch(r"sk_test_[0-9A-Za-z]{43,}", issued.secret)
    row = db.session.scalar(select(ApiKey).where(ApiKey.merchant_id == merchant.id))
    assert row.key_hash == services.hash_api_key(issued.secret)
    assert issued.secret not in (row.key_hash, row.display_prefix)
    assert issued.secret.startswith(row.display_prefix)
    assert len(row.display_prefix) < 16
    assert merchant.email == "shop@example.com"
    assert services.authenticate(issued.secret) == merchant.id


def test_keys_are_unique(app):
    merchant, first = services.create_merchant("a@example.com", "long enough password")
    secrets = {first.secret} | {services.create_api_key(merchant.id).secret for _ in range(20)}
    assert len(secrets) == 21


def test_password_is_hashed_with_argon2(app):
    merchant, _ = services.create_merchant("a@example.com", "long enough password")
    stored = db.session.get(Merchant, merchant.id).password_hash
    assert stored.startswith("$argon2")
    assert services.verify_password(stored, "long enough password")
    assert not services.verify_password(stored, "wrong password!")


@pytest.mark.parametrize(
    ("email", "password", "code"),
    [
        ("not-an-email", "long enough password", "INVALID_EMAIL"),
        ("a@example.com", "short", "WEAK_PASSWORD"),
        ("", "long enough password", "INVALID_EMAIL"),
    ],
)
def test_create_merchant_refuses_bad_input(app, email, password, code):
    with pytest.raises(MerchantError) as caught:
        services.create_merchant(email, password)
    assert caught.value.code == code
    assert db.session.scalar(select(Merchant.id)) is None


def test_duplicate_email_is_refused(app):
    services.create_merchant("a@example.com", "long enough password")
    with pytest.raises(MerchantError) as caught:
        services.create_merchant("A@example.com", "long enough password")
    assert caught.value.code == "EMAIL_TAKEN"


def test_revoke_is_scoped_to_the_merchant(app):
    owner, issued = services.create_merchant("a@example.com", "long enough password")
    stranger, _ = services.create_merchant("b@example.com", "long enough password")
    with pytest.raises(MerchantError) as caught:
        services.revoke_api_key(stranger.id, issued.key.id)
    assert caught.value.code == "KEY_NOT_FOUND"
    assert services.authenticate(issued.secret) == owner.id


def test_one_wallet_per_network_replaced_in_place(app, chains):
    merchant, _ = services.create_merchant("a@example.com", "long enough password")
    services.set_wallet(merchant.id, "eip155:84532", "0x70997970c51812dc3a010c7d01b50e0d17dc79c8", chains)
    services.set_wallet(merchant.id, "eip155:84532", "0x3c44cdddb6a900fa2b585dd299e03d12fa4293bc", chains)
    wallets = db.session.scalars(select(Wallet).where(Wallet.merchant_id == merchant.id)).all()
    assert [(w.network, w.address) for w in wallets] == [("eip155:84532", "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC")]


@pytest.mark.parametrize(
    ("network", "address", "code"),
    [
        ("eip155:84532", "0x1234", "INVALID_ADDRESS"),
        ("eip155:84532", "0x70997970C51812dc3A010C7d01b50e0d17dc79c8", "INVALID_ADDRESS"),  # bad checksum
        ("eip155:84532", "0x0000000000000000000000000000000000000000", "INVALID_ADDRESS"),
        ("eip155:84532", "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM", "INVALID_ADDRESS"),
        ("solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", "0x70997970C51812dc3A010C7d01b50e0d17dc79C8", "INVALID_ADDRESS"),
        ("solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWW0", "INVALID_ADDRESS"),
        ("solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", "11111111111111111111111111111111", "INVALID_ADDRESS"),
        ("eip155:1", "0x70997970C51812dc3A010C7d01b50e0d17dc79C8", "UNKNOWN_NETWORK"),
    ],
)
def test_wallet_address_is_validated_per_network(app, chains, network, address, code):
    merchant, _ = services.create_merchant("a@example.com", "long enough password")
    with pytest.raises(MerchantError) as caught:
        services.set_wallet(merchant.id, network, address, chains)
    assert caught.value.code == code
    assert db.session.scalar(select(Wallet.id)) is None


def test_solana_wallet_is_kept_as_given(app, chains):
    merchant, _ = services.create_merchant("a@example.com", "long enough password")
    wallet = services.set_wallet(
        merchant.id, "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM", chains
    )
    assert wallet.address == "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM"


def test_the_services_own_addresses_are_not_payout_wallets(app):
    """Second review, Low: a wallet could be the relay (the Solana fee payer, an EVM relay account) or the USDC
    contract / mint. Refused on every network of the kind (a relay key or token is often the same on several
    chains); nothing is written."""
    from backend.chains.registry import ChainRegistry, Network

    relay_evm, relay_sol = "0x90F79bf6EB2c4f870365E785982E1f101E93b906", "5ZWj7a1f8tWkjBESHKgrLmXshuXxqeY9SYcfbshpAqPG"
    base = Network("eip155:84532", "Base Sepolia", "evm", None, "0x036CbD53842c5426634e7929541eC2318f3dCF7e")
    sepolia = Network("eip155:11155111", "Ethereum Sepolia", "evm", None, "0x1c7D4B196Cb0C7B01d743Fbc6116a902379C7238",
                      relay_addresses=(relay_evm,))  # fmt: skip
    solana = Network("solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", "Solana Devnet", "solana", None,
                     "4zMMC9srt5Ri5X14GAgXhaHii3GnPAEERYPJgZJDncDU", fee_payer=relay_sol)  # fmt: skip
    registry = ChainRegistry([base, sepolia, solana])
    merchant, _ = services.create_merchant("a@example.com", "long enough password")
    refused = [
        (base.network, base.usdc_address.lower()),  # the token contract, in any case
        (base.network, relay_evm),  # Ethereum Sepolia's relay account, registered on Base Sepolia
        (sepolia.network, base.usdc_address),  # another network's USDC contract
        (solana.network, relay_sol),  # the fee payer
        (solana.network, solana.usdc_address),  # the mint
        (solana.network, "TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA"),  # a program the payment calls
    ]
    for network, address in refused:
        with pytest.raises(MerchantError) as caught:
            services.set_wallet(merchant.id, network, address, registry)
        assert caught.value.code == "ADDRESS_NOT_ALLOWED", (network, address)
    assert db.session.scalar(select(Wallet.id)) is None
    services.set_wallet(merchant.id, base.network, "0x70997970C51812dc3A010C7d01b50e0d17dc79C8", registry)
    services.set_wallet(merchant.id, solana.network, "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM", registry)
