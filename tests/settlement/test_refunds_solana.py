"""Refunds on the local Solana (LiteSVM): the merchant's wallet signs the prepared transaction, the relay pays the
fee, the buyer gets exactly the refund once."""

from __future__ import annotations

from typing import Any

from solders.keypair import Keypair
from sqlalchemy import select

from backend.extensions import db
from backend.settlement.models import PayeeAccount
from payintent import solana_tx as stx
from tests.settlement.test_pay import create_intent, pay
from tests.settlement.test_pay_solana import SOLANA, buyer, lamports, signed_payment, sol, sol_shop, usdc  # noqa: F401
from tests.settlement.test_refunds import REFUNDS, create_refund, pay_refund, refund_events


def prepared(client: Any, shop: Any, refund: dict[str, Any]) -> Any:
    return client.post(f"{REFUNDS}/{refund['refund_id']}/solana-transaction", headers=shop.headers)


def test_a_solana_refund_lands_once_in_the_buyers_account_and_the_relay_pays_the_fee(pay_client, sol_shop, devnet, sol):  # noqa: F811
    payer = buyer(devnet, 0)
    buyer_address = str(payer.pubkey())
    intent = create_intent(pay_client, sol_shop, 2.5)
    paid = pay(pay_client, sol_shop, intent, SOLANA, signed_payment(pay_client, sol_shop, intent, payer))
    assert paid.status_code == 200, paid.data
    created = create_refund(pay_client, sol_shop, intent["intent_id"], amount_usdc=1)
    assert created.status_code == 201, created.data
    refund = created.get_json()["data"]
    (req,) = refund["payment_requirements"]
    assert req["network"] == SOLANA and req["payTo"] == buyer_address and req["maxAmountRequired"] == "1000000"
    assert refund["pay_from"] == sol_shop.wallet

    answer = prepared(pay_client, sol_shop, refund)
    assert answer.status_code == 200, answer.data
    data = answer.get_json()["data"]
    assert data["payer"] == sol_shop.wallet and data["creates_payee_account"] is False
    tx = stx.sign_as(stx.decode(data["transaction"]), sol_shop.keypair)
    buyer_before, wallet_sol = usdc(sol, devnet, buyer_address), lamports(sol, sol_shop.wallet)
    done = pay_refund(pay_client, sol_shop, refund, {"transaction": stx.encode(tx)})
    assert done.status_code == 200, done.data
    result = done.get_json()["data"]
    assert result["status"] == "succeeded"
    status = sol.signature_status(result["tx_hash"])
    assert status is not None and status["err"] is None
    assert usdc(sol, devnet, buyer_address) - buyer_before == 1_000_000
    assert usdc(sol, devnet, sol_shop.wallet) == 1_500_000
    assert lamports(sol, sol_shop.wallet) == wallet_sol  # the relay paid the fee
    # A refund landing in the buyer's account records nothing: the payee-account rule is about merchants' accounts.
    db.session.expire_all()
    assert db.session.scalars(select(PayeeAccount).where(PayeeAccount.owner == buyer_address)).all() == []
    (event,) = refund_events()
    assert event["refund_id"] == refund["refund_id"] and event["tx_hash"] == result["tx_hash"]
    assert event["chain"] == SOLANA

    # The same signed transaction again moves nothing; so does a new refund's transaction prepared now but
    # signed by someone other than the merchant's wallet.
    again = pay_refund(pay_client, sol_shop, refund, {"transaction": stx.encode(tx)})
    assert again.status_code == 409 and again.get_json()["error"]["code"] == "REFUND_NOT_PAYABLE"
    second = create_refund(pay_client, sol_shop, intent["intent_id"], amount_usdc=0.5).get_json()["data"]
    stranger = Keypair()
    fresh = prepared(pay_client, sol_shop, second).get_json()["data"]
    forged = stx.build_payment(fee_payer=fresh["fee_payer"], payer=str(stranger.pubkey()), mint=req["asset"],
                               pay_to=buyer_address, amount_atomic=500_000, intent_id=second["refund_id"],
                               recent_blockhash=fresh["recent_blockhash"])  # fmt: skip
    refused = pay_refund(pay_client, sol_shop, second, {"transaction": stx.encode(stx.sign_as(forged, stranger))})
    assert refused.status_code == 400 and refused.get_json()["error"]["code"] == "REFUND_SIGNER_MISMATCH"
    assert usdc(sol, devnet, buyer_address) - buyer_before == 1_000_000
    read = pay_client.get(f"/api/v1/x402/intents/{intent['intent_id']}", headers=sol_shop.headers).get_json()["data"]
    assert read["refunded_usdc"] == 1 and [r["status"] for r in read["refunds"]] == ["succeeded", "requires_signature"]
