"""A Solana settlement whose co-signed transaction may still land is never released unwatched (review R1, R2).

A released Solana settlement is not watched (``Rail.released_may_execute()`` is False): failing one whose relay
signature is recorded (its send in flight, or a lagging node that does not know it yet) would let that
transaction land later with nothing recording the buyer's second payment. The relayer leaves it open instead
and the chain decides: landed → recorded as a duplicate payment, blockhash expired → failed. And a transaction
the node saw but did not confirm is sent again (same signature), so a dropped broadcast is not left to expire.
Runs on the in-process Solana devnet.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from solders.keypair import Keypair

from backend import clock
from backend.chains.solana import SolanaChain, SolanaRpcError, solana_chain
from backend.extensions import db
from backend.intents.models import Intent
from backend.rails.registry import rail_for
from backend.rails.solana.relay import SolanaRelayKeys
from backend.relaybudget.models import RelaySpend
from backend.settlement import services
from backend.settlement.models import Settlement
from backend.settlement.reconcile import LEDGER, reconcile
from payintent import solana_tx as stx
from relayer import tasks
from tests.settlement.test_pay import create_intent, events, pay
from tests.settlement.test_pay_solana import (  # noqa: F401  (fixtures)
    SOLANA,
    buyer,
    relay_keypair,
    signed_payment,
    sol,
    sol_shop,
    usdc,
)


def _cosigned_claim(client: Any, devnet: Any, shop: Any, intent: dict[str, Any], payer: Keypair, *,
                    claimed: bool, expiring: bool = False) -> tuple[str, Any]:  # fmt: skip
    """A settlement of ``payer``'s signed transaction, checked by the rail as /pay checks it, that the relay
    co-signed and recorded (``mark_submitted``) but whose send has not reached the node yet; returns its id and
    the co-signed transaction. ``expiring``: its ``last_valid_block_height`` is the height now."""
    network = devnet.chains.get(SOLANA)
    rail = rail_for(network)
    (requirement,) = intent["payment_requirements"]
    payload = signed_payment(client, shop, intent, payer)
    terms = rail.parse_payment(network, requirement, payload, intent["intent_id"], clock.now())
    terms = rail.check_on_chain(network, requirement, terms, LEDGER).terms
    if expiring:
        terms = dataclasses.replace(terms, last_valid_block_height=solana_chain(network).block_height("finalized"))
    now = clock.now()
    settlement_id = f"stl_{secrets.token_hex(8)}"
    db.session.add(
        Settlement(
            id=settlement_id,
            intent_id=intent["intent_id"],
            merchant_id=shop.id,
            network=SOLANA,
            asset=network.usdc_address,
            status="pending",
            created_at=now,
            updated_at=now,
            **rail.columns_of(terms),
        )
    )
    db.session.commit()
    if claimed:
        db.session.execute(
            db.update(Intent).where(Intent.id == intent["intent_id"]).values(settlement_id=settlement_id)
        )
        db.session.commit()
    relay = relay_keypair(devnet)
    cosigned = stx.sign_as(stx.decode(payload["transaction"]), relay)
    services.mark_submitted(settlement_id, str(cosigned.signatures[0]), str(relay.pubkey()), relay_nonce=None)
    return settlement_id, cosigned


@pytest.fixture
def relay_keys(devnet: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tasks.RELAY_KEYS, SOLANA, SolanaRelayKeys(relay_keypair(devnet)))


def row(settlement_id: str) -> Settlement:
    db.session.expire_all()
    found = db.session.get(Settlement, settlement_id)
    assert found is not None
    return found


def land(sol: SolanaChain, cosigned: Any) -> str:  # noqa: F811
    """The in-flight send reaches the node."""
    signature = sol.send(stx.encode(cosigned))
    deadline = time.monotonic() + 10
    while (sol.signature_status(signature) or {}).get("confirmationStatus") != "finalized":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return signature


def reconcile_later(devnet: Any) -> dict[str, int]:
    """The reconciler as if a minute had passed (it looks at settlements left alone), without a queue."""
    later = datetime.now(UTC) + timedelta(seconds=60)
    clock.set_clock(lambda: later)
    try:
        return reconcile(devnet.chains, None)
    finally:
        clock.set_clock(None)


def test_a_cosigned_claim_is_not_released_when_another_pays_and_its_late_landing_is_a_duplicate(
    sol_shop,  # noqa: F811
    pay_client,
    devnet,
    sol,  # noqa: F811
    relay_keys,
):
    first, second = buyer(devnet, 0), buyer(devnet, 1)
    intent = create_intent(pay_client, sol_shop, 1)
    settlement_id, cosigned = _cosigned_claim(pay_client, devnet, sol_shop, intent, first, claimed=False)
    signature = str(cosigned.signatures[0])
    before = usdc(sol, devnet, str(first.pubkey()))
    # Meanwhile another payment of the intent settles (a released EVM authorization executed late, say).
    paid = pay(pay_client, sol_shop, intent, SOLANA, signed_payment(pay_client, sol_shop, intent, second))
    assert paid.status_code == 200, paid.data
    paid_tx = paid.get_json()["data"]["tx_hash"]
    assert usdc(sol, devnet, sol_shop.wallet) == 1_000_000
    # The relayer retries the first one: its signature is unknown to the node, the intent is paid by another. It
    # is neither released (nothing would watch it) nor sent again (a knowing second charge).
    assert tasks._settle(settlement_id, None) == "waiting-for-chain"  # type: ignore[arg-type]
    assert tasks._settle(settlement_id, None) == "waiting-for-chain"  # type: ignore[arg-type]
    assert row(settlement_id).status == "submitted" and row(settlement_id).failure_code is None
    assert sol.signature_status(signature) is None and usdc(sol, devnet, sol_shop.wallet) == 1_000_000
    # The send that was in flight lands: the buyer paid twice, and the reconciler records it as a duplicate.
    assert land(sol, cosigned) == signature
    assert usdc(sol, devnet, sol_shop.wallet) == 2_000_000
    assert before - usdc(sol, devnet, str(first.pubkey())) == 1_000_000
    reconcile_later(devnet)
    settled = row(settlement_id)
    assert (settled.status, settled.failure_code, settled.tx_hash) == ("confirmed", "DUPLICATE_PAYMENT", signature)
    assert [s.id for s in services.duplicate_payments(intent["intent_id"])] == [settlement_id]
    duplicates = [e for e in events("payment.duplicate") if e["data"]["intent_id"] == intent["intent_id"]]
    assert [(e["data"]["tx_hash"], e["data"]["paid_tx_hash"]) for e in duplicates] == [(signature, paid_tx)]
    db.session.expire_all()
    kept = db.session.get(Intent, intent["intent_id"])
    assert kept is not None and kept.status == "paid" and kept.tx_hash == paid_tx
    fee = db.session.scalars(db.select(RelaySpend).where(RelaySpend.reference == signature)).all()
    assert [(f.kind, f.settlement_id) for f in fee] == [("fee", settlement_id)]  # the relay's fee, charged once


def test_a_cosigned_claim_that_can_never_land_fails_once_its_blockhash_expired(
    sol_shop,  # noqa: F811
    pay_client,
    devnet,
    sol,  # noqa: F811
    relay_keys,
):
    first, second = buyer(devnet, 0), buyer(devnet, 2)
    intent = create_intent(pay_client, sol_shop, 1)
    settlement_id, cosigned = _cosigned_claim(pay_client, devnet, sol_shop, intent, first, claimed=False,
                                              expiring=True)  # fmt: skip
    paid = pay(pay_client, sol_shop, intent, SOLANA, signed_payment(pay_client, sol_shop, intent, second))
    assert paid.status_code == 200, paid.data
    assert tasks._settle(settlement_id, None) == "waiting-for-chain"  # type: ignore[arg-type]
    failed_before = len(events("payment.failed"))
    sol.call("devnet_expireBlockhashes")  # the transaction's blockhash is dead, the height past its last valid one
    assert tasks._settle(settlement_id, None) == "finished-from-chain"  # type: ignore[arg-type]
    settled = row(settlement_id)
    assert (settled.status, settled.failure_code) == ("failed", "AUTHORIZATION_EXPIRED")
    with pytest.raises(SolanaRpcError):  # it can never land
        land(sol, cosigned)
    assert usdc(sol, devnet, sol_shop.wallet) == 1_000_000
    assert services.duplicate_payments(intent["intent_id"]) == []
    assert len(events("payment.failed")) == failed_before  # the intent is paid: nothing failed for the merchant


def test_a_cosigned_claim_the_relay_now_refuses_is_left_for_the_chain(
    sol_shop,  # noqa: F811
    pay_client,
    devnet,
    sol,  # noqa: F811
    relay_keys,
    monkeypatch,
):
    """The relay's own check refuses the transaction now (its rules changed since it co-signed it): nothing is
    sent, but what it signed before may still land, so the settlement is not released."""
    intent = create_intent(pay_client, sol_shop, 1)
    settlement_id, cosigned = _cosigned_claim(pay_client, devnet, sol_shop, intent, buyer(devnet, 0), claimed=True)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise stx.SolanaTransactionError("ASSET_MISMATCH", "the mint changed")

    monkeypatch.setattr(stx, "check_payment", refuse)
    assert tasks._settle(settlement_id, None) == "waiting-for-chain"  # type: ignore[arg-type]
    assert row(settlement_id).status == "submitted"
    signature = land(sol, cosigned)
    assert tasks._settle(settlement_id, None) == "finished-from-chain"  # type: ignore[arg-type]
    settled = row(settlement_id)
    assert (settled.status, settled.failure_code, settled.tx_hash) == ("confirmed", None, signature)
    assert usdc(sol, devnet, sol_shop.wallet) == 1_000_000


def test_a_transaction_seen_but_not_confirmed_is_sent_again(
    sol_shop,  # noqa: F811
    pay_client,
    devnet,
    sol,  # noqa: F811
    relay_keys,
    monkeypatch,
):
    """The node reports our signature ``processed`` (a fork that then died; our sends ask for no retries): the
    same signed transaction is sent again rather than left to expire."""
    intent = create_intent(pay_client, sol_shop, 1)
    settlement_id, cosigned = _cosigned_claim(pay_client, devnet, sol_shop, intent, buyer(devnet, 1), claimed=True)
    signature = str(cosigned.signatures[0])
    real = SolanaChain.signature_status

    def seen(self: SolanaChain, wanted: str) -> dict[str, Any] | None:
        status = real(self, wanted)
        if status is None and wanted == signature:  # seen once, dropped since
            return {"slot": 1, "confirmations": 0, "err": None, "confirmationStatus": "processed"}
        return status

    monkeypatch.setattr(SolanaChain, "signature_status", seen)
    assert tasks._settle(settlement_id, None) == "confirmed"  # type: ignore[arg-type]
    settled = row(settlement_id)
    assert (settled.status, settled.tx_hash) == ("confirmed", signature)
    assert usdc(sol, devnet, sol_shop.wallet) == 1_000_000
    assert len([e for e in events("payment.completed") if e["data"]["intent_id"] == intent["intent_id"]]) == 1
