"""The Solana payee-account record ("a payment of ours landed in this account", ``solana_payee_accounts``): written
before the settlement is finished, so it is never lost, and per mint (hostile review of b9d84f5, F1 and F2).

F1: the record was written in its own commit after the payment was marked paid, and skipped when the genesis hash
could not be read then. An RPC error (or the relayer dying) at that moment lost it for good: the settlement was
finished, nothing looked at it again, and once the merchant closed the account the next buyer was asked for its rent
again. Now the genesis hash is read first; if it cannot be read the settlement stays open for the reconciler, and the
record is written before the settlement is marked paid.

F2: the record ignored the mint. After the operator moved a Solana network to another USDC mint, every merchant paid
before was refused 409 PAYEE_ACCOUNT_CLOSED though it closed nothing (its account for the new mint simply does not
exist yet). Now the record is per mint.

A fake Solana RPC (an RPC outage at an exact moment cannot be made on a real validator), the real database (both
engines) and the real API and reconciler. The same paths on the real validator: tests/settlement/test_relay_spending.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from sqlalchemy import select

from backend.chains.registry import ChainRegistry
from backend.chains.solana import Blockhash, SolanaRpcError
from backend.extensions import db
from backend.intents.models import Intent
from backend.settlement import reconcile, services, solana
from backend.settlement.models import PayeeAccount
from payintent import solana_tx as stx
from tests.conftest import create_merchant, make_settings, truncate_all

RPC = "http://fake-solana.invalid"
NET = "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"
RELAY = Keypair()
BLOCKHASH = "4uQeVj5tqViQh7yWWGStvkEG1Zmhx6uasJtWCJziofM"
RENT = 2_039_280
GENESIS = "GENESIS-1"


class FakeChain:
    """A Solana RPC: token accounts that exist (address -> balance), lamports, signature statuses."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.sol: dict[str, int] = {}
        self.statuses: dict[str, dict[str, Any]] = {}
        self.genesis_fails = False

    def genesis_hash(self) -> str:
        if self.genesis_fails:
            raise SolanaRpcError("getGenesisHash: RPC unreachable or malformed answer (ReadTimeout)")
        return GENESIS

    def latest_blockhash(self) -> Blockhash:
        return Blockhash(BLOCKHASH, 1000)

    def token_balance(self, account: str) -> int | None:
        return self.tokens.get(account)

    def rent_exempt_minimum(self, size: int) -> int:
        return RENT if size else 890_880

    def lamports(self, address: str) -> int:
        return self.sol.get(address, 0)

    def block_height(self, commitment: str = "confirmed") -> int:
        return 10

    def signature_status(self, signature: str) -> dict[str, Any] | None:
        return self.statuses.get(signature)

    def is_blockhash_valid(self, blockhash: str) -> bool:
        return True


def ata(owner: Keypair, mint: str) -> str:
    return str(stx.associated_token_address(owner.pubkey(), Pubkey.from_string(mint)))


def make_app(db_url: str, tmp_path: Any, mint: str) -> Any:
    from backend.app import create_app

    path = tmp_path / f"chains-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps({"networks": [{
        "network": NET, "name": "Solana Devnet", "kind": "solana", "rpc_url": RPC,
        "usdc_address": mint, "fee_payer": str(RELAY.pubkey()),
    }]}))  # fmt: skip
    return create_app(make_settings(db_url, chains_file=str(path)), chains=ChainRegistry.load(str(path)))


@pytest.fixture
def world(db_url: str, tmp_path: Any, clock: Any) -> Any:
    truncate_all(db_url)
    mint = str(Keypair().pubkey())
    app = make_app(db_url, tmp_path, mint)
    chain = FakeChain()
    solana._chains[RPC] = chain  # type: ignore[assignment]
    with app.app_context():
        yield app, chain, mint
        db.session.remove()
        db.engine.dispose()
    solana._chains.pop(RPC, None)


def new_intent(app: Any, shop: Any) -> str:
    answer = app.test_client().post(
        "/api/v1/x402/intents", json={"amount_usdc": 1, "order_id": "o"}, headers=shop.headers
    )
    assert answer.status_code == 201, answer.data
    return str(answer.get_json()["data"]["intent_id"])


def prepare(app: Any, intent_id: str, buyer: Keypair) -> Any:
    return app.test_client().post(
        f"/api/v1/checkout/intents/{intent_id}/solana-transaction", json={"payer": str(buyer.pubkey()), "network": NET}
    )


def funded(chain: FakeChain, mint: str, *buyers: Keypair) -> None:
    for buyer in buyers:
        chain.tokens[ata(buyer, mint)] = 5_000_000
        chain.sol[str(buyer.pubkey())] = 10_000_000


def land_first_payment(app: Any, chain: FakeChain, shop: Any, owner: Keypair, mint: str, buyer: Keypair) -> str:
    """A buyer's first payment: it opens the merchant's account (the buyer pays RENT), is claimed and sent, and
    lands on chain. Returns the settlement id (not finished yet: the caller finishes it)."""
    intent_id = new_intent(app, shop)
    prepared = prepare(app, intent_id, buyer)
    assert prepared.status_code == 200, prepared.data
    data = prepared.get_json()["data"]
    assert data["creates_payee_account"] and data["payer_pays_lamports"] == RENT
    tx = stx.sign_as(stx.sign_as(stx.decode(data["transaction"]), buyer), RELAY)
    row = db.session.get(Intent, intent_id)
    assert row is not None
    requirement = row.payment_requirements[0]
    payment = stx.check_payment(tx, requirement, row.id, str(RELAY.pubkey()))
    auth = solana.SolanaAuthorization(payer=payment.payer, pay_to=requirement["payTo"], value=payment.amount_atomic,
                                      last_valid_block_height=10 + 300, nonce_hex="0x" + payment.message_hash,
                                      transaction=stx.encode(tx))  # fmt: skip
    settlement_id = services.claim(row.id, row.merchant_id, app.extensions["payintent.chains"].get(NET), auth, None)
    signature = str(tx.signatures[0])
    services.mark_submitted(settlement_id, signature, str(RELAY.pubkey()), relay_nonce=None)
    chain.tokens[ata(owner, mint)] = 1_000_000  # the account is opened (the buyer's rent) and the payment lands
    chain.statuses[signature] = {"confirmationStatus": "confirmed", "err": None}
    return settlement_id


def finish(app: Any, settlement_id: str) -> bool:
    """The settlement finished from the chain (the stand-in), as the relayer and the reconciler do."""
    settlement = services.get_settlement(settlement_id)
    assert settlement is not None
    return reconcile.finish_from_chain(app.extensions["payintent.chains"].get(NET), settlement)


def records() -> list[tuple[str, str, str]]:
    db.session.expire_all()
    rows = db.session.execute(select(PayeeAccount.owner, PayeeAccount.mint, PayeeAccount.genesis_hash))
    return sorted((owner, mint, genesis) for owner, mint, genesis in rows)


def closed_refusal(answer: Any) -> None:
    assert answer.status_code == 409, answer.data
    assert answer.get_json()["error"]["code"] == "PAYEE_ACCOUNT_CLOSED"


def test_an_rpc_error_at_finishing_leaves_the_settlement_open_and_the_record_is_written_later(world, clock):
    """The review's attack (F1): getGenesisHash fails at the moment the relayer finishes the landed first payment.
    Before: the settlement was confirmed without the record, and after the merchant closed its account the next
    buyer was asked for the rent again (200, payer_pays_lamports = RENT). Now the settlement stays open; the
    reconciler finishes it once the RPC answers, with the record; the next buyer is refused."""
    app, chain, mint = world
    owner, first, second = Keypair(), Keypair(), Keypair()
    shop = create_merchant(app, f"m-{uuid.uuid4().hex[:6]}@example.com", {NET: str(owner.pubkey())})
    funded(chain, mint, first, second)
    settlement_id = land_first_payment(app, chain, shop, owner, mint, first)
    chain.genesis_fails = True  # one RPC hiccup as the relayer finishes the landed payment
    assert finish(app, settlement_id) is False
    db.session.expire_all()
    assert services.get_settlement(settlement_id).status == "submitted"  # open: the reconciler visits it
    assert records() == []
    chain.genesis_fails = False
    clock.advance(seconds=reconcile.STALE_AFTER.total_seconds() + 1)
    assert reconcile.reconcile(app.extensions["payintent.chains"], None)["finished"] == 1
    db.session.expire_all()
    assert services.get_settlement(settlement_id).status == "confirmed"
    assert records() == [(str(owner.pubkey()), mint, GENESIS)]
    # The merchant closes its account and takes the first buyer's rent back: no buyer pays it again.
    del chain.tokens[ata(owner, mint)]
    closed_refusal(prepare(app, new_intent(app, shop), second))


def test_the_record_is_written_before_the_payment_is_marked_paid(world, monkeypatch):
    """The relayer dies right after the settlement is marked paid (the other way F1 lost the record): the record
    is already there, so the next buyer is refused once the merchant closed the account."""
    app, chain, mint = world
    owner, first, second = Keypair(), Keypair(), Keypair()
    shop = create_merchant(app, f"m-{uuid.uuid4().hex[:6]}@example.com", {NET: str(owner.pubkey())})
    funded(chain, mint, first, second)
    settlement_id = land_first_payment(app, chain, shop, owner, mint, first)
    complete = services.complete_settlement

    def complete_then_die(sid: str, tx_hash: str) -> bool:
        complete(sid, tx_hash)
        raise SystemExit("the relayer is killed right after the payment is marked paid")

    monkeypatch.setattr(services, "complete_settlement", complete_then_die)
    with pytest.raises(SystemExit):
        finish(app, settlement_id)
    db.session.rollback()
    db.session.expire_all()
    assert services.get_settlement(settlement_id).status == "confirmed"
    assert records() == [(str(owner.pubkey()), mint, GENESIS)]
    del chain.tokens[ata(owner, mint)]
    closed_refusal(prepare(app, new_intent(app, shop), second))


def test_a_new_usdc_mint_does_not_make_merchants_paid_before_look_closed(world, db_url, tmp_path):
    """The review's attack (F2): the operator moves the network to another USDC mint on the same cluster. Before:
    every merchant with a record for the old mint was refused 409 PAYEE_ACCOUNT_CLOSED. Now the first payment in
    the new mint opens the merchant's new account (the buyer pays the rent, as on any first payment), and the record
    of the old mint still refuses to open the old account again at a buyer's cost."""
    app, chain, mint = world
    owner, buyer = Keypair(), Keypair()
    shop = create_merchant(app, f"m-{uuid.uuid4().hex[:6]}@example.com", {NET: str(owner.pubkey())})
    funded(chain, mint, buyer)
    assert finish(app, land_first_payment(app, chain, shop, owner, mint, buyer))
    assert records() == [(str(owner.pubkey()), mint, GENESIS)]
    new_mint = str(Keypair().pubkey())
    moved = make_app(db_url, tmp_path, new_mint)
    with moved.app_context():
        funded(chain, new_mint, buyer)
        answer = prepare(moved, new_intent(moved, shop), buyer)
        assert answer.status_code == 200, answer.data
        data = answer.get_json()["data"]
        assert data["creates_payee_account"] is True and data["payer_pays_lamports"] == RENT
        db.session.remove()
    # Back on the old mint, with the old account closed: still refused (the record of that mint holds).
    del chain.tokens[ata(owner, mint)]
    closed_refusal(prepare(app, new_intent(app, shop), buyer))
