"""Buyers who insist, and the ledger that checks nothing was lost or paid twice.

A :class:`Buyer` thread creates one intent (with an Idempotency-Key, retried through outages) and
pays it the way an impatient agent would: an answer that is not an outcome (a dropped connection,
a 5xx, "still settling") makes it wait for the intent, then post again, half the time the same
authorization and half the time a freshly signed one (a new nonce: the one way a buyer could be
charged twice). It stops when the intent reads ``paid`` or its deadline passes.

:func:`audit` then checks, per drill, against the chain (Anvil, directly) and the database:
each intent's authorizations executed on chain (double-charged when more than one, unrecorded when
one moved money but the intent is not paid), buyer and merchant balances against the paid
amounts, one confirmed settlement and one ``payment.completed`` event per paid intent, and every
event of the drill received by both webhook receivers (lost when one never arrived).
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from drills.helpers import received
from drills.stack import RECEIVERS, Stack
from harness import audit as onchain

INTENTS = "/api/v1/x402/intents"
PAY = "/api/v1/x402/pay"
ATOMIC = Decimal(1_000_000)


@dataclass
class Payment:
    key: str
    network: str
    buyer: dict[str, str]
    amount: Decimal
    intent_id: str | None = None
    nonces: list[str] = field(default_factory=list)
    answers: Counter[str] = field(default_factory=Counter)
    paid: bool = False
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def atomic(self) -> int:
        return int(self.amount * ATOMIC)


def make_payments(stack: Stack, tag: str, count: int, rng: random.Random) -> list[Payment]:
    return [
        Payment(
            key=f"drill-{tag}-{i}-{rng.getrandbits(32):08x}",
            network=stack.networks[i % len(stack.networks)],
            buyer=stack.buyers[i % len(stack.buyers)],
            amount=Decimal(rng.randint(100, 999)) / 100,
        )
        for i in range(count)
    ]


def _code(status: int, body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"{status} {body['error'].get('code')}"
    return str(status)


class Buyer(threading.Thread):
    def __init__(self, stack: Stack, payment: Payment, deadline: float, seed: int) -> None:
        super().__init__(name=f"buyer-{payment.key}", daemon=True)
        self.stack = stack
        self.p = payment
        self.deadline = deadline
        self.rng = random.Random(seed)

    def call(self, method: str, path: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
        try:
            status, answer = self.stack.api(method, path, body, **kwargs)
        except (OSError, http.client.HTTPException) as exc:  # the API is down, or died mid-request (IncompleteRead)
            self.p.answers[f"connection {type(exc).__name__}"] += 1
            return 0, None
        if status != 200 or method != "GET":
            self.p.answers[_code(status, answer)] += 1
        return status, answer

    def run(self) -> None:
        try:
            requirement = self.create()
            if requirement is not None:
                self.pay(requirement)
        except Exception as exc:  # a bug of the drill itself: reported, never taken for a service fault
            self.p.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.p.done.set()

    def create(self) -> dict[str, Any] | None:
        body = {"amount_usdc": self.p.amount, "order_id": self.p.key, "description": "drill"}
        while time.monotonic() < self.deadline:
            status, answer = self.call("POST", INTENTS, body, idempotency_key=self.p.key, timeout=30)
            if status in (200, 201):
                self.p.intent_id = answer["data"]["intent_id"]
                return next(r for r in answer["data"]["payment_requirements"] if r["network"] == self.p.network)
            time.sleep(0.5)
        return None

    def signed(self, requirement: dict[str, Any]) -> dict[str, Any]:
        from payintent.eip3009 import sign_authorization

        payload = sign_authorization(self.p.buyer["private_key"], requirement)
        self.p.nonces.append(payload["nonce"])  # recorded before anything is sent
        return {
            "intent_id": self.p.intent_id,
            "payment_signature": {"scheme": "exact", "network": self.p.network, "x402Version": 1, "payload": payload},
        }

    def pay(self, requirement: dict[str, Any]) -> None:
        body = self.signed(requirement)
        while time.monotonic() < self.deadline:
            status, answer = self.call("POST", PAY, body, timeout=60)
            code = _code(status, answer)
            if status == 200 or code == "409 ALREADY_PAID":
                self.p.paid = True
                return
            if self.wait_paid(20 if status in (0, 504) or code.endswith("PAYMENT_IN_PROGRESS") else 2):
                return
            if self.rng.random() < 0.5 or code.endswith(("SETTLEMENT_FAILED", "NONCE_ALREADY_USED", "EXPIRED")):
                body = self.signed(requirement)
            time.sleep(self.rng.uniform(0.2, 1.0))

    def wait_paid(self, seconds: float) -> bool:
        """Poll the intent until it reads paid (True) or `seconds` pass (False)."""
        until = min(self.deadline, time.monotonic() + seconds)
        while time.monotonic() < until:
            status, answer = self.call("GET", f"{INTENTS}/{self.p.intent_id}", timeout=10)
            if status == 200 and answer["data"]["status"] == "paid":
                self.p.paid = True
                return True
            time.sleep(0.5)
        return False


def start_buyers(stack: Stack, payments: list[Payment], deadline: float, rng: random.Random) -> list[Buyer]:
    buyers = [Buyer(stack, p, deadline, rng.getrandbits(32)) for p in payments]
    for buyer in buyers:
        buyer.start()
    return buyers


def wait_all(payments: list[Payment], deadline: float) -> None:
    for p in payments:
        p.done.wait(max(0.0, deadline - time.monotonic()))


# --- the audit -----------------------------------------------------------------------------------------


@dataclass
class Figures:
    attempted: int = 0
    settled: int = 0
    double_charged: int = 0
    unrecorded: int = 0
    events: int = 0
    lost: int = 0
    redelivered: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


@dataclass
class Snapshot:
    """Balances before a drill: buyers per network, the payout address per network."""

    buyers: dict[tuple[str, str], int]
    payout: str
    payouts: dict[tuple[str, str], int] = field(default_factory=dict)  # the payout address's, per network


def snapshot(stack: Stack) -> Snapshot:
    balances = {(n, b["address"]): stack.balance(n, b["address"]) for n in stack.networks for b in stack.buyers}
    payouts = {(n, stack.payout): stack.balance(n, stack.payout) for n in stack.networks}
    return Snapshot(balances, stack.payout, payouts)


def _rows(
    stack: Stack, intent_ids: list[str]
) -> tuple[dict[str, Any], Counter[str], dict[str, str], dict[str, list[str]]]:
    import sqlalchemy as sa

    engine = sa.create_engine(stack.database_url, poolclass=sa.pool.NullPool)
    ids = sa.bindparam("ids", expanding=True)
    try:
        with engine.connect() as conn:
            intents = {
                row.id: row
                for row in conn.execute(
                    sa.text("SELECT id, status, amount_atomic, chain FROM intents WHERE id IN :ids").bindparams(ids),
                    {"ids": intent_ids},
                )
            }
            confirmed: Counter[str] = Counter()
            tx_hashes: dict[str, str] = {}
            for row in conn.execute(
                sa.text(
                    "SELECT intent_id, tx_hash FROM settlements WHERE status = 'confirmed' AND intent_id IN :ids"
                ).bindparams(ids),
                {"ids": intent_ids},
            ):
                confirmed[row.intent_id] += 1
                tx_hashes[row.intent_id] = row.tx_hash
            events: dict[str, list[str]] = defaultdict(list)
            for row in conn.execute(
                sa.text("SELECT id, type, intent_id FROM events WHERE intent_id IN :ids").bindparams(ids),
                {"ids": intent_ids},
            ):
                events[row.type].append(row.id)
                if row.type == "payment.completed":
                    events[f"completed:{row.intent_id}"].append(row.id)
    finally:
        engine.dispose()
    return intents, confirmed, tx_hashes, events


def _intents_per_order(stack: Stack, order_ids: list[str]) -> Counter[str]:
    import sqlalchemy as sa

    engine = sa.create_engine(stack.database_url, poolclass=sa.pool.NullPool)
    query = sa.text("SELECT order_id FROM intents WHERE order_id IN :ids").bindparams(
        sa.bindparam("ids", expanding=True)
    )
    try:
        with engine.connect() as conn:
            found = Counter(row.order_id for row in conn.execute(query, {"ids": order_ids}))
    finally:
        engine.dispose()
    return Counter({key: found[key] for key in order_ids})


def audit(stack: Stack, payments: list[Payment], before: Snapshot, events_deadline: float) -> Figures:
    figures = Figures(attempted=len(payments))
    for p in payments:
        figures.answers.update(p.answers)
        if p.error:
            figures.problems.append(f"the buyer of {p.key} broke: {p.error}")
    created = [p for p in payments if p.intent_id]
    if len(created) != len(payments):
        figures.problems.append(f"{len(payments) - len(created)} intents were never created")
    for key, count in _intents_per_order(stack, [p.key for p in payments]).items():
        if count != 1:  # a create retried through an outage must not make a second intent (Idempotency-Key)
            figures.problems.append(f"{count} intents for order {key}")
    intents, confirmed, tx_hashes, events = _rows(stack, [p.intent_id for p in created if p.intent_id])
    paid: list[onchain.Paid] = []
    for p in created:
        intent = intents[p.intent_id]
        executed = sum(1 for nonce in p.nonces if stack.authorization_used(p.network, p.buyer["address"], nonce))
        is_paid = intent.status == "paid"
        figures.settled += is_paid
        if intent.amount_atomic != p.atomic:
            figures.problems.append(f"intent {p.intent_id} asks {intent.amount_atomic} atomic USDC, not {p.atomic}")
        if p.paid and not is_paid:
            figures.problems.append(f"intent {p.intent_id}: the API said paid, the intent is {intent.status}")
        figures.double_charged += max(0, executed - 1)
        if executed and not is_paid:
            figures.unrecorded += 1
        if is_paid and executed != 1:
            figures.problems.append(f"intent {p.intent_id} is paid but {executed} of its authorizations executed")
        if is_paid and confirmed[p.intent_id] != 1:
            figures.problems.append(f"intent {p.intent_id} is paid with {confirmed[p.intent_id]} confirmed settlements")
        if is_paid and len(events.get(f"completed:{p.intent_id}", [])) != 1:
            figures.problems.append(f"intent {p.intent_id}: {len(events.get(f'completed:{p.intent_id}', []))} "
                                    "payment.completed events")  # fmt: skip
        if is_paid:
            tx_hash = tx_hashes.get(p.intent_id)
            paid.append(onchain.Paid(p.network, p.buyer["address"], before.payout, intent.amount_atomic, tx_hash))
        if not is_paid:
            figures.problems.append(f"intent {p.intent_id} is {intent.status} at the end (answers {dict(p.answers)})")
    # On chain (harness.audit): each paid intent's transaction moved exactly its amount to the merchant, once;
    # every buyer's and the payout address's balance changed by exactly the paid amounts.
    tokens = {n: onchain.Token(stack.anvil_url[n], stack.usdc[n]) for n in stack.networks}
    figures.problems += onchain.audit(tokens, paid, {**before.buyers, **before.payouts})
    expected = {event_id for kind, ids in events.items() if ":" not in kind for event_id in ids}
    figures.events = len(expected) * len(RECEIVERS)
    figures.lost, figures.redelivered = _deliveries(stack, expected, events_deadline)
    return figures


def _deliveries(stack: Stack, expected: set[str], deadline: float) -> tuple[int, int]:
    """(lost, redelivered): events of `expected` missing at a receiver by `deadline`, and extra copies."""
    while True:
        counts = {name: Counter(str(body.get("id")) for body in received(stack.receiver_log[name]))
                  for name in RECEIVERS}  # fmt: skip
        lost = sum(1 for name in RECEIVERS for event_id in expected if counts[name][event_id] == 0)
        if lost == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    redelivered = sum(max(0, counts[name][event_id] - 1) for name in RECEIVERS for event_id in expected)
    return lost, redelivered


# --- the audit's control: planted faults it must find ----------------------------------------------------


def execute_behind_the_service(stack: Stack, p: Payment, requirement: dict[str, Any]) -> None:
    """Sign a new authorization for the payment's requirement and execute it on chain directly, as
    the devnet's deployer: money moves without the service knowing (what a bug could do)."""
    import json

    from eth_account import Account
    from web3 import Web3

    from devnet.stack import ARTIFACT
    from payintent.eip3009 import sign_authorization

    payload = sign_authorization(p.buyer["private_key"], requirement)
    p.nonces.append(payload["nonce"])
    w3 = Web3(Web3.HTTPProvider(stack.anvil_url[p.network]))
    abi = json.loads(ARTIFACT.read_text())["abi"]
    token = w3.eth.contract(address=Web3.to_checksum_address(stack.usdc[p.network]), abi=abi)
    call = token.get_function_by_signature(
        "transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,bytes)"
    )(
        Web3.to_checksum_address(payload["from"]), Web3.to_checksum_address(payload["to"]), int(payload["value"]),
        int(payload["validAfter"]), int(payload["validBefore"]), bytes.fromhex(payload["nonce"][2:]),
        bytes.fromhex(payload["signature"][2:]),
    )  # fmt: skip
    deployer = Account.from_key(stack.deployer_key)
    tx = call.build_transaction({"from": deployer.address, "nonce": w3.eth.get_transaction_count(deployer.address)})
    receipt = w3.eth.wait_for_transaction_receipt(
        w3.eth.send_raw_transaction(deployer.sign_transaction(tx).raw_transaction)
    )
    if receipt["status"] != 1:
        raise RuntimeError("the planted transfer reverted")


def control(stack: Stack, rng: random.Random) -> list[str]:
    """Plant one double charge, one unrecorded charge and one missing event; the audit must report
    exactly those. Returns problems (empty when it did)."""
    stack.new_payout_wallets()
    before = snapshot(stack)
    paid, unpaid = make_payments(stack, "control", 2, rng)
    deadline = time.monotonic() + 120
    buyer = Buyer(stack, paid, deadline, rng.getrandbits(32))
    requirement = buyer.create()
    assert requirement is not None
    buyer.pay(requirement)  # settles through the service
    execute_behind_the_service(stack, paid, requirement)  # a second authorization for the same intent
    other = Buyer(stack, unpaid, deadline, rng.getrandbits(32)).create()
    assert other is not None
    execute_behind_the_service(stack, unpaid, other)  # money moved, no /pay, the intent stays pending
    figures = audit(stack, [paid, unpaid], before, time.monotonic() + 30)
    lost, _ = _deliveries(stack, {"evt_planted_never_sent"}, time.monotonic())
    problems = []
    if (figures.double_charged, figures.unrecorded, lost) != (1, 1, len(RECEIVERS)):
        problems.append(
            f"the audit's control: planted 1 double charge, 1 unrecorded charge, 1 missing event; it found "
            f"{figures.double_charged}, {figures.unrecorded}, {lost} missing deliveries"
        )
    if not any("(an unrecorded charge)" in problem for problem in figures.problems):  # harness.audit's balances
        problems.append("the audit's control: the buyers' balances did not show the planted charges")
    return problems
