"""Paying on the local Solana (LiteSVM behind a JSON-RPC server): money moves once, the relay pays fees only."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from backend.chains.solana import SolanaChain
from backend.extensions import db
from payintent import solana_tx as stx
from relayer.faults import CRASH_EXIT_CODE
from tests.conftest import create_merchant
from tests.settlement.conftest import stop_process
from tests.settlement.test_pay import create_intent, events, pay
from tests.settlement.test_recovery import iso  # noqa: F401  (fixture)

SOLANA = "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"


@pytest.fixture
def sol(devnet) -> SolanaChain:
    return SolanaChain(devnet.info["solana"]["rpc_url"])


@pytest.fixture
def sol_shop(pay_app: Any, devnet: Any) -> Any:
    """A merchant paid on Solana to a fresh wallet (its USDC account does not exist yet)."""
    keypair = Keypair()
    wallet = keypair.pubkey()
    handle = create_merchant(pay_app, f"sol-{str(wallet)[:8].lower()}@example.com", {SOLANA: str(wallet)})
    handle.wallet = str(wallet)  # type: ignore[attr-defined]
    handle.keypair = keypair  # type: ignore[attr-defined]
    return handle


def buyer(devnet: Any, index: int = 0) -> Keypair:
    return Keypair.from_base58_string(devnet.info["solana_buyers"][index]["secret_key"])


def usdc(sol: SolanaChain, devnet: Any, owner: str) -> int:
    mint = Pubkey.from_string(devnet.info["solana"]["usdc_mint"])
    return sol.token_balance(str(stx.associated_token_address(Pubkey.from_string(owner), mint))) or 0


def lamports(sol: SolanaChain, owner: str) -> int:
    return int(sol.call("getBalance", [owner])["value"])


def signed_payment(client: Any, shop: Any, intent: dict[str, Any], keypair: Keypair) -> dict[str, Any]:
    response = client.post(
        f"/api/v1/x402/intents/{intent['intent_id']}/solana-transaction",
        json={"payer": str(keypair.pubkey())},
        headers=shop.headers,
    )
    assert response.status_code == 200, response.data
    tx = stx.decode(response.get_json()["data"]["transaction"])
    return {"transaction": stx.encode(stx.sign_as(tx, keypair))}


def test_happy_path_moves_exactly_the_amount_and_the_relay_pays_the_fee(pay_client, sol_shop, devnet, sol):
    payer = buyer(devnet, 0)
    intent = create_intent(pay_client, sol_shop, 2.5)
    (requirement,) = intent["payment_requirements"]
    assert requirement["network"] == SOLANA and requirement["payTo"] == sol_shop.wallet
    assert requirement["extra"] == {"decimals": 6, "feePayer": devnet.info["solana"]["fee_payer"]}
    payload = signed_payment(pay_client, sol_shop, intent, payer)
    buyer_usdc, buyer_sol = usdc(sol, devnet, str(payer.pubkey())), lamports(sol, str(payer.pubkey()))
    response = pay(pay_client, sol_shop, intent, SOLANA, payload)
    assert response.status_code == 200, response.data
    data = response.get_json()["data"]
    assert data["network"] == SOLANA and data["buyer_address"] == str(payer.pubkey())
    assert usdc(sol, devnet, sol_shop.wallet) == 2_500_000
    assert buyer_usdc - usdc(sol, devnet, str(payer.pubkey())) == 2_500_000
    # The buyer paid no fee; this first payment to a new wallet opened its USDC account, at the buyer's cost.
    rent = sol.rent_exempt_minimum(stx.TOKEN_ACCOUNT_SIZE)
    assert buyer_sol - lamports(sol, str(payer.pubkey())) == rent
    status = sol.signature_status(data["tx_hash"])
    assert status is not None and status["err"] is None
    read = pay_client.get(f"/api/v1/x402/intents/{intent['intent_id']}", headers=sol_shop.headers).get_json()["data"]
    assert read["status"] == "paid" and read["tx_hash"] == data["tx_hash"] and read["chain"] == SOLANA
    (completed,) = events("payment.completed")
    assert completed["data"]["tx_hash"] == data["tx_hash"]
    # A retry of the same transaction, or a new one, is ALREADY_PAID and moves nothing.
    again = pay(pay_client, sol_shop, intent, SOLANA, payload)
    assert again.status_code == 409 and again.get_json()["error"]["code"] == "ALREADY_PAID"
    assert usdc(sol, devnet, sol_shop.wallet) == 2_500_000


def test_tampered_transactions_are_refused_and_move_nothing(pay_client, sol_shop, devnet, sol):
    payer = buyer(devnet, 1)
    intent = create_intent(pay_client, sol_shop, 1)
    good = stx.decode(signed_payment(pay_client, sol_shop, intent, payer)["transaction"])
    requirement = intent["payment_requirements"][0]
    thief = Keypair().pubkey()
    variants = {
        "RECIPIENT_MISMATCH": dict(pay_to=str(thief)),
        "AMOUNT_MISMATCH": dict(amount_atomic=1),
        "ASSET_MISMATCH": dict(mint=str(Keypair().pubkey())),
        "COMPUTE_BUDGET_TOO_HIGH": dict(unit_price=stx.MAX_COMPUTE_UNIT_PRICE + 1),
    }
    for code, override in variants.items():
        args = {"fee_payer": requirement["extra"]["feePayer"], "payer": str(payer.pubkey()),
                "mint": requirement["asset"], "pay_to": requirement["payTo"], "amount_atomic": 1_000_000,
                "intent_id": intent["intent_id"], "recent_blockhash": str(good.message.recent_blockhash),
                **override}  # fmt: skip
        tx = stx.sign_as(stx.build_payment(**args), payer)
        response = pay(pay_client, sol_shop, intent, SOLANA, {"transaction": stx.encode(tx)})
        assert response.status_code == 400, (code, response.data)
        assert response.get_json()["error"]["code"] == code
    unsigned = stx.encode(good.__class__.populate(good.message, [good.signatures[0], good.signatures[0]]))
    response = pay(pay_client, sol_shop, intent, SOLANA, {"transaction": unsigned})
    assert response.get_json()["error"]["code"] == "INVALID_SIGNATURE"
    assert usdc(sol, devnet, sol_shop.wallet) == 0
    read = pay_client.get(f"/api/v1/x402/intents/{intent['intent_id']}", headers=sol_shop.headers).get_json()["data"]
    assert read["status"] == "pending"


def test_a_stale_blockhash_is_refused(pay_client, sol_shop, devnet, sol):
    payer = buyer(devnet, 1)
    intent = create_intent(pay_client, sol_shop, 1)
    payload = signed_payment(pay_client, sol_shop, intent, payer)
    sol.call("devnet_expireBlockhashes")
    response = pay(pay_client, sol_shop, intent, SOLANA, payload)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "BLOCKHASH_EXPIRED"
    fresh = signed_payment(pay_client, sol_shop, intent, payer)
    assert pay(pay_client, sol_shop, intent, SOLANA, fresh).status_code == 200
    assert usdc(sol, devnet, sol_shop.wallet) == 1_000_000


def test_concurrent_payers_move_money_once(pay_client, sol_shop, devnet, sol):
    intent = create_intent(pay_client, sol_shop, 3)
    payers = [buyer(devnet, i) for i in range(3)]
    payloads = [signed_payment(pay_client, sol_shop, intent, p) for p in payers]
    before = [usdc(sol, devnet, str(p.pubkey())) for p in payers]
    with ThreadPoolExecutor(3) as pool:
        codes = list(pool.map(lambda p: pay(pay_client, sol_shop, intent, SOLANA, p), payloads))
    assert sum(r.status_code == 200 for r in codes) == 1, [r.data for r in codes]
    assert {r.get_json()["error"]["code"] for r in codes if r.status_code != 200} <= {"ALREADY_PAID",
                                                                                     "PAYMENT_IN_PROGRESS"}  # fmt: skip
    assert usdc(sol, devnet, sol_shop.wallet) == 3_000_000
    moved = sum(b - usdc(sol, devnet, str(p.pubkey())) for b, p in zip(before, payers, strict=True))
    assert moved == 3_000_000


def test_relayer_killed_after_send_ends_paid_once(iso, devnet, sol):  # noqa: F811
    shop = create_merchant(iso.app, "sol-crash-1@example.com", {SOLANA: str(Keypair().pubkey())})
    wallet = shop_wallet(iso.app, shop)
    intent = create_intent(iso.client, shop, 4)
    crashing = iso.relayer(fault="after-broadcast")
    try:
        payload = signed_payment(iso.client, shop, intent, buyer(devnet, 2))
        response = pay(iso.client, shop, intent, SOLANA, payload)
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    assert response.status_code == 504 and response.get_json()["error"]["code"] == "SETTLEMENT_PENDING"
    deadline = time.monotonic() + 10
    while usdc(sol, devnet, wallet) != 4_000_000:  # the chain moved the money ...
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert iso.intent_row(intent["intent_id"]).status == "pending"  # ... but nobody recorded it yet
    assert iso.reconcile_later()["finished"] == 1
    row = iso.intent_row(intent["intent_id"])
    assert row.status == "paid" and row.tx_hash == iso.settlement(intent["intent_id"]).tx_hash
    assert len(iso.completed_events(intent["intent_id"])) == 1
    assert iso.reconcile_later()["finished"] == 0
    assert usdc(sol, devnet, wallet) == 4_000_000


def test_relayer_killed_before_send_is_sent_again(iso, devnet, sol):  # noqa: F811
    shop = create_merchant(iso.app, "sol-crash-2@example.com", {SOLANA: str(Keypair().pubkey())})
    wallet = shop_wallet(iso.app, shop)
    intent = create_intent(iso.client, shop, 2)
    crashing = iso.relayer(fault="after-mark-submitted")
    try:
        payload = signed_payment(iso.client, shop, intent, buyer(devnet, 0))
        assert pay(iso.client, shop, intent, SOLANA, payload).status_code == 504
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    assert usdc(sol, devnet, wallet) == 0  # recorded as submitted, never sent
    healthy = iso.relayer()
    try:
        assert iso.reconcile_later()["resent"] == 1
        row = iso.wait_paid(intent["intent_id"])
    finally:
        stop_process(healthy)
    assert usdc(sol, devnet, wallet) == 2_000_000
    assert row.tx_hash == iso.settlement(intent["intent_id"]).tx_hash
    assert len(iso.completed_events(intent["intent_id"])) == 1


def shop_wallet(app: Any, shop: Any) -> str:
    from backend.merchants.models import Wallet

    return db.session.scalars(db.select(Wallet.address).where(Wallet.merchant_id == shop.id)).one()


def relay_keypair(devnet: Any) -> Keypair:
    import json
    from pathlib import Path

    keys = json.loads(Path(devnet.info["relay_keys_file"]).read_text())
    return Keypair.from_base58_string(keys[SOLANA][0])


def test_the_relay_never_cosigns_a_tampered_stored_transaction(pay_app, pay_client, sol_shop, devnet, sol, monkeypatch):
    """Even if the database were altered, the relayer checks the transaction again before signing."""
    from solders.system_program import TransferParams, transfer

    from backend.rails.solana.relay import SolanaRelayKeys
    from backend.settlement.models import Settlement
    from relayer import tasks

    payer = buyer(devnet, 2)
    intent = create_intent(pay_client, sol_shop, 1)
    good = stx.decode(signed_payment(pay_client, sol_shop, intent, payer)["transaction"])
    relay = relay_keypair(devnet)
    thief = Keypair().pubkey()
    # A transaction that would move the relay's SOL, stored as if it were the buyer's.
    from solders.hash import Hash
    from solders.message import MessageV0
    from solders.signature import Signature
    from solders.transaction import VersionedTransaction

    evil_message = MessageV0.try_compile(
        relay.pubkey(), [transfer(TransferParams(from_pubkey=relay.pubkey(), to_pubkey=thief, lamports=10**9))], [],
        Hash.from_string(str(good.message.recent_blockhash)),
    )  # fmt: skip
    evil = VersionedTransaction.populate(evil_message, [Signature.default()])
    network = devnet.chains.get(SOLANA)
    row = Settlement(
        id="stl_tampered", intent_id=intent["intent_id"], merchant_id=sol_shop.id, network=SOLANA,
        asset=network.usdc_address, payer=str(payer.pubkey()), pay_to=sol_shop.wallet, amount_atomic=1_000_000,
        last_valid_block_height=10**9, nonce="0x" + "ab" * 32, signed_transaction=stx.encode(evil), status="pending",
        created_at=__import__("backend.clock", fromlist=["now"]).now(),
        updated_at=__import__("backend.clock", fromlist=["now"]).now(),
    )  # fmt: skip
    db.session.add(row)
    db.session.commit()
    monkeypatch.setitem(tasks.RELAY_KEYS, SOLANA, SolanaRelayKeys(relay))
    outcome = tasks._settle(row.id, None)  # type: ignore[arg-type]  # no Redis: a Solana send leases nothing
    assert outcome == "refused-by-relay"
    assert lamports(sol, str(thief)) == 0
    db.session.expire_all()
    assert db.session.get(Settlement, "stl_tampered").status == "failed"


def test_the_checkout_reads_a_solana_buyers_balance(pay_client, sol_shop, sol, devnet):
    intent = create_intent(pay_client, sol_shop, 2)
    url = f"/api/v1/checkout/intents/{intent['intent_id']}/balance"
    network = devnet.info["solana"]["network"]
    owner = str(buyer(devnet, 2).pubkey())
    funded = pay_client.get(url, query_string={"network": network, "address": owner}).get_json()["data"]
    assert int(funded["balance_atomic"]) == usdc(sol, devnet, owner) > 0 and funded["required_atomic"] == "2000000"
    nobody = str(Keypair().pubkey())  # no token account at all
    empty = pay_client.get(url, query_string={"network": network, "address": nobody}).get_json()["data"]
    assert empty["balance_atomic"] == "0"
    evm_address = pay_client.get(url, query_string={"network": network, "address": "0x" + "11" * 20})
    assert evm_address.status_code == 400 and evm_address.get_json()["error"]["code"] == "VALIDATION_ERROR"
