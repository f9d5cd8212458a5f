"""The relay budget bounds what the relay spends, not only which payments start: a payment is admitted only
if what the merchant's relay already spent on the network, plus what its open settlements may still cost,
plus this one's most, fits the budget; concurrent payments are admitted one after the other; and a merchant
has at most MAX_OPEN_SETTLEMENTS open settlements per network. Real devnet, relayer processes, balances on
chain, both engines.

The attacks (second review): with the relayer stopped, a merchant paying itself got every payment accepted
past a used-up budget (all were sent once the relayer started); with a running relayer, concurrent /pay
calls all passed a budget that one payment used up.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest
from solders.keypair import Keypair
from sqlalchemy import func, select

from backend.chains.solana import SolanaChain
from backend.extensions import db
from backend.rails.evm import rail as evm_rail
from backend.rails.evm.relay import EVM_SETTLEMENT_GAS
from backend.relaybudget import services as relaybudget
from backend.relaybudget.models import GAS, RelaySpend
from payintent import solana_tx as stx
from payintent.eip3009 import sign_authorization
from tests.conftest import create_merchant
from tests.settlement.conftest import make_pay_app, start_relayer, stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_pay_solana import SOLANA, buyer, lamports, usdc
from tests.settlement.test_relay_spending import public_client, public_pay, relay_balances

EVM = "eip155:84532"
OTHER_EVM = "eip155:11155111"
SOL_MAX = stx.MAX_TRANSACTION_FEE  # 10,500 lamports: the most one Solana settlement costs the relay
EVM_PAYOUT = "0x000000000000000000000000000000000000dEaD"


class Bounded:
    """An API on its own relayer queue: no relayer takes its settlements until the test starts one."""

    def __init__(self, app: Any, queue: str, db_url: str, redis_url: str, devnet: Any) -> None:
        self.app, self.queue, self.db_url, self.redis_url, self.devnet = app, queue, db_url, redis_url, devnet

    def settings(self, **changes: Any) -> Any:
        settings = replace(self.app.config["PAYINTENT_SETTINGS"], **changes)
        self.app.config["PAYINTENT_SETTINGS"] = settings
        return settings

    def evm_cost(self, network: str, merchant_id: str = "") -> int:
        """The most one of the merchant's settlements may cost (by default a merchant with no charges yet)."""
        network_ = self.devnet.chains.get(network)
        return relaybudget.max_settlement_cost(network_, self.app.config["PAYINTENT_SETTINGS"], merchant_id)

    def relayer(self) -> Any:
        return start_relayer(self.db_url, self.redis_url, self.devnet.info["chains_file"], RELAYER_QUEUE=self.queue)


@pytest.fixture
def bounded(db_url: str, redis_server_url: str, devnet: Any) -> Iterator[Bounded]:
    queue = f"relayer-budget-{uuid.uuid4().hex[:8]}"
    app = make_pay_app(db_url, redis_server_url, devnet, relayer_queue=queue, pay_wait_seconds=1)
    with app.app_context():
        yield Bounded(app, queue, db_url, redis_server_url, devnet)
        db.session.remove()
        db.engine.dispose()


@pytest.fixture
def sol(devnet: Any) -> SolanaChain:
    return SolanaChain(devnet.info["solana"]["rpc_url"])


def ledger(merchant_id: str, network: str) -> tuple[int, int]:
    """(rows, total) the relay_spending ledger holds for the merchant on the network."""
    db.session.expire_all()
    count, total = db.session.execute(
        select(func.count(), func.coalesce(func.sum(RelaySpend.amount_atomic), 0)).where(
            RelaySpend.merchant_id == merchant_id, RelaySpend.network == network
        )
    ).one()
    return int(count), int(total)


def wait_statuses(client: Any, shop: Any, ids: list[str], done: Any, seconds: float = 120) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        statuses = [
            client.get(f"/api/v1/x402/intents/{i}", headers=shop.headers).get_json()["data"]["status"] for i in ids
        ]
        if done(statuses) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.5)


def solana_shop(app: Any) -> Any:
    owner = Keypair()
    return create_merchant(app, f"sb-{uuid.uuid4().hex[:8]}@example.com", {SOLANA: str(owner.pubkey())}), owner


def signed_solana(client: Any, shop: Any, payer: Keypair, count: int) -> list[tuple[str, str]]:
    """``count`` intents of 0.01 USDC, each with its transaction prepared and signed by ``payer`` (before any pays)."""
    signed = []
    for _ in range(count):
        intent = create_intent(client, shop, 0.01)
        prepared = client.post(
            f"/api/v1/checkout/intents/{intent['intent_id']}/solana-transaction",
            json={"payer": str(payer.pubkey()), "network": SOLANA},
        )
        assert prepared.status_code == 200, prepared.data
        tx = stx.decode(prepared.get_json()["data"]["transaction"])
        signed.append((intent["intent_id"], stx.encode(stx.sign_as(tx, payer))))
    return signed


def codes(responses: list[Any]) -> list[str]:
    return [
        "accepted" if r.status_code in (200, 504) else f"{r.status_code} {r.get_json()['error']['code']}"
        for r in responses
    ]


def test_the_most_a_settlement_costs(bounded, devnet, clock):
    """Solana: exact (two signatures and the largest priority fee the rules allow). EVM: the gas bound at twice
    the node's gas price (cached per network), or the merchant's own highest gas charge of the window if that
    is more, up to EVM_HISTORY_CAP times the bound; never another merchant's."""
    settings = bounded.app.config["PAYINTENT_SETTINGS"]
    shop = create_merchant(bounded.app, f"cost-{uuid.uuid4().hex[:8]}@example.com", {EVM: EVM_PAYOUT})
    other = create_merchant(bounded.app, f"cost2-{uuid.uuid4().hex[:8]}@example.com", {EVM: EVM_PAYOUT})
    assert relaybudget.max_settlement_cost(devnet.chains.get(SOLANA), settings, shop.id) == SOL_MAX == 10_500
    evm_rail.cost_cache.pop(EVM, None)
    least = EVM_SETTLEMENT_GAS * 2 * devnet.w3(EVM).eth.gas_price
    assert bounded.evm_cost(EVM, shop.id) == least
    relaybudget.charge(shop.id, EVM, GAS, least * 3, "0xspike")  # an L1 fee, a fee spike: the ledger shows it
    assert bounded.evm_cost(EVM, shop.id) == least * 3
    assert bounded.evm_cost(EVM, other.id) == least  # another merchant's charges are not this one's estimate
    relaybudget.charge(shop.id, EVM, GAS, least * 50, "0xhuge")  # a past spike: capped
    assert bounded.evm_cost(EVM, shop.id) == least * relaybudget.EVM_HISTORY_CAP
    clock.advance(seconds=settings.relay_budget_window_seconds + 1)  # rolled out of the window
    assert bounded.evm_cost(EVM, shop.id) == least


def test_one_merchants_costly_settlement_does_not_refuse_other_merchants(bounded, devnet, clock):
    """The review's attack (F3): the EVM estimate was the highest gas charge on the network by ANY merchant in the
    window, so one merchant's settlement costing more than a budget refused every other merchant's payments
    (429 RELAY_BUDGET_EXHAUSTED, though they spent nothing) for a day. Now each merchant's estimate comes from
    the relay's limits and its own charges only: the other merchant pays; the costly one is refused (its own
    spending)."""
    budget = 4 * bounded.evm_cost(EVM)
    bounded.settings(relay_budgets=((EVM, Decimal(budget).scaleb(-18)),))
    client = bounded.app.test_client()
    payout = __import__("web3").Web3.to_checksum_address("0x" + secrets.token_hex(20))
    costly = create_merchant(bounded.app, f"cx-{uuid.uuid4().hex[:8]}@example.com", {EVM: payout})
    victim = create_merchant(bounded.app, f"cv-{uuid.uuid4().hex[:8]}@example.com", {EVM: payout})
    # One settlement of the costly merchant cost more than a whole budget (a stand-in in the ledger: a real one
    # cannot be made that dear on the devnet).
    relaybudget.charge(costly.id, EVM, GAS, budget + 1, "0x" + secrets.token_hex(32))
    evm_rail.cost_cache.pop(EVM, None)

    def pay_once(merchant: Any) -> Any:
        intent = create_intent(client, merchant, 0.01)
        signed = sign_authorization(devnet.buyer(2).key, requirement(intent, EVM), now=int(clock().timestamp()))
        return pay(client, merchant, intent, EVM, signed)  # signed at the service's (frozen) time

    assert codes([pay_once(victim)]) == ["accepted"]  # before the fix: 429 RELAY_BUDGET_EXHAUSTED
    assert codes([pay_once(costly)]) == ["429 RELAY_BUDGET_EXHAUSTED"]
    clock.advance(seconds=bounded.app.config["PAYINTENT_SETTINGS"].relay_budget_window_seconds - 60)
    evm_rail.cost_cache.pop(EVM, None)
    assert codes([pay_once(victim)]) == ["accepted"]  # and a day later (before: still refused)


# --- a backlog accepted while the relayer is stopped -----------------------------------------------------


def test_solana_payments_accepted_while_the_relayer_is_stopped_stay_within_the_budget(bounded, devnet, sol):
    budget = 2 * SOL_MAX + SOL_MAX // 2  # room for two settlements at their most, not three
    bounded.settings(relay_budgets=((SOLANA, Decimal(budget).scaleb(-9)),))
    client = public_client(bounded.app)
    shop, owner = solana_shop(bounded.app)
    relay = devnet.info["solana"]["fee_payer"]
    signed = signed_solana(client, shop, buyer(devnet, 0), 6)
    relay_before = lamports(sol, relay)
    answers = [public_pay(client, intent_id, tx) for intent_id, tx in signed]
    # Before the fix all six were accepted (the spent sum was still 0), and sent once the relayer started.
    assert codes(answers) == ["accepted"] * 2 + ["429 RELAY_BUDGET_EXHAUSTED"] * 4, [r.data for r in answers]
    assert all(r.status_code == 504 for r in answers[:2])  # claimed, waiting for a relayer
    assert answers[2].headers["Retry-After"] == str(relaybudget.IN_FLIGHT_RETRY_SECONDS)  # the open ones block it
    relayer = bounded.relayer()
    try:
        ids = [intent_id for intent_id, _ in signed]
        statuses = wait_statuses(client, shop, ids, lambda s: s.count("paid") >= 2)
    finally:
        stop_process(relayer)
    assert statuses == ["paid"] * 2 + ["pending"] * 4
    assert usdc(sol, devnet, str(owner.pubkey())) == 2 * 10_000
    count, total = ledger(shop.id, SOLANA)
    assert count == 2 and relay_before - lamports(sol, relay) == total <= budget  # on chain, and recorded
    # Finished, the two are spent: a third payment does not fit (told before the buyer signs, too).
    late = create_intent(client, shop, 0.01)
    prepared = client.post(f"/api/v1/checkout/intents/{late['intent_id']}/solana-transaction",
                           json={"payer": str(buyer(devnet, 0).pubkey()), "network": SOLANA})  # fmt: skip
    assert codes([prepared]) == ["429 RELAY_BUDGET_EXHAUSTED"]
    assert int(prepared.headers["Retry-After"]) > relaybudget.IN_FLIGHT_RETRY_SECONDS  # until the spending rolls out


def test_evm_payments_accepted_while_the_relayer_is_stopped_stay_within_the_budget(bounded, devnet):
    cost = bounded.evm_cost(EVM)
    budget = 2 * cost + cost // 2
    bounded.settings(relay_budgets=((EVM, Decimal(budget).scaleb(-18)),))
    client = bounded.app.test_client()
    payout = __import__("web3").Web3.to_checksum_address("0x" + secrets.token_hex(20))
    shop = create_merchant(bounded.app, f"eb-{uuid.uuid4().hex[:8]}@example.com", {EVM: payout})
    relay_before = relay_balances(devnet, EVM)
    intents = [create_intent(client, shop, 0.01) for _ in range(6)]
    answers = [
        pay(client, shop, intent, EVM, sign_authorization(devnet.buyer(0).key, requirement(intent, EVM)))
        for intent in intents
    ]
    assert codes(answers) == ["accepted"] * 2 + ["429 RELAY_BUDGET_EXHAUSTED"] * 4, [r.data for r in answers]
    relayer = bounded.relayer()
    try:
        ids = [intent["intent_id"] for intent in intents]
        statuses = wait_statuses(client, shop, ids, lambda s: s.count("paid") >= 2)
    finally:
        stop_process(relayer)
    assert statuses == ["paid"] * 2 + ["pending"] * 4
    assert devnet.balance(EVM, payout) == 2 * 10_000
    count, total = ledger(shop.id, EVM)
    assert count == 2 and relay_before - relay_balances(devnet, EVM) == total <= budget


# --- concurrent payments with a running relayer ------------------------------------------------------------


def test_concurrent_solana_payments_cannot_all_pass_the_budget(pay_app, devnet, sol):
    budget = 2 * SOL_MAX + SOL_MAX // 2
    pay_app.config["PAYINTENT_SETTINGS"] = replace(
        pay_app.config["PAYINTENT_SETTINGS"], relay_budgets=((SOLANA, Decimal(budget).scaleb(-9)),)
    )
    client = public_client(pay_app)
    shop, owner = solana_shop(pay_app)
    relay = devnet.info["solana"]["fee_payer"]
    signed = signed_solana(client, shop, buyer(devnet, 1), 8)
    relay_before = lamports(sol, relay)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda s: public_pay(public_client(pay_app), *s), signed))
    outcome = codes(answers)
    paid = sum(r.status_code == 200 for r in answers)
    # Before the fix: all passed the check before the first one was charged (the review saw 6 of 12 paid).
    assert outcome.count("accepted") == paid <= 2 and paid >= 1, outcome
    assert set(outcome) <= {"accepted", "429 RELAY_BUDGET_EXHAUSTED"}, outcome
    assert usdc(sol, devnet, str(owner.pubkey())) == paid * 10_000
    count, total = ledger(shop.id, SOLANA)
    assert count == paid and relay_before - lamports(sol, relay) == total <= budget


def test_concurrent_evm_payments_cannot_all_pass_the_budget(pay_app, devnet):
    cost = relaybudget.max_settlement_cost(devnet.chains.get(EVM), pay_app.config["PAYINTENT_SETTINGS"], "")
    budget = 2 * cost + cost // 2
    pay_app.config["PAYINTENT_SETTINGS"] = replace(
        pay_app.config["PAYINTENT_SETTINGS"], relay_budgets=((EVM, Decimal(budget).scaleb(-18)),)
    )
    client = pay_app.test_client()
    payout = __import__("web3").Web3.to_checksum_address("0x" + secrets.token_hex(20))
    shop = create_merchant(pay_app, f"ec-{uuid.uuid4().hex[:8]}@example.com", {EVM: payout})
    intents = [create_intent(client, shop, 0.01) for _ in range(6)]
    payloads = [(i, sign_authorization(devnet.buyer(1).key, requirement(i, EVM))) for i in intents]
    relay_before = relay_balances(devnet, EVM)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: pay(pay_app.test_client(), shop, p[0], EVM, p[1]), payloads))
    outcome = codes(answers)
    paid = sum(r.status_code == 200 for r in answers)
    # Admission reserves the estimate (``cost``) per open settlement, but a finished one is charged what it
    # really cost (less): a payment admitted after two finished can fit too. What must hold is the budget.
    assert outcome.count("accepted") == paid < len(intents) and paid >= 1, outcome
    assert set(outcome) <= {"accepted", "429 RELAY_BUDGET_EXHAUSTED"}, outcome
    assert devnet.balance(EVM, payout) == paid * 10_000
    count, total = ledger(shop.id, EVM)
    assert count == paid and relay_before - relay_balances(devnet, EVM) == total <= budget


# --- the cap on open settlements ------------------------------------------------------------------------


def test_a_merchant_has_at_most_max_open_settlements_per_network(bounded, devnet):
    """Budget or not (unlimited here), one merchant cannot queue more than the cap of payments per network;
    other merchants and the merchant's other networks are not affected."""
    bounded.settings(max_open_settlements=2, relay_budget_evm=None)
    client = bounded.app.test_client()
    payout = __import__("web3").Web3.to_checksum_address("0x" + secrets.token_hex(20))
    shop = create_merchant(bounded.app, f"cap-{uuid.uuid4().hex[:8]}@example.com", {EVM: payout, OTHER_EVM: payout})
    other = create_merchant(bounded.app, f"cap2-{uuid.uuid4().hex[:8]}@example.com", {EVM: payout})

    def pay_once(merchant: Any, network: str) -> Any:
        intent = create_intent(client, merchant, 0.01)
        payload = sign_authorization(devnet.buyer(2).key, requirement(intent, network))
        return pay(client, merchant, intent, network, payload)

    answers = [pay_once(shop, EVM) for _ in range(3)]
    assert codes(answers) == ["accepted", "accepted", "429 TOO_MANY_OPEN_SETTLEMENTS"]
    error = answers[2].get_json()["error"]
    assert error["network"] == EVM and answers[2].headers["Retry-After"] == str(error["retry_after"])
    assert codes([pay_once(shop, OTHER_EVM), pay_once(other, EVM)]) == ["accepted", "accepted"]
    relayer = bounded.relayer()
    try:
        assert wait_open(shop.id, EVM, 0)  # finished: room again
    finally:
        stop_process(relayer)
    assert codes([pay_once(shop, EVM)]) == ["accepted"]


def wait_open(merchant_id: str, network: str, wanted: int, seconds: float = 90) -> bool:
    from backend.settlement.services import count_open

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        db.session.expire_all()
        if count_open(merchant_id, network) == wanted:
            return True
        db.session.rollback()
        time.sleep(0.5)
    return False
