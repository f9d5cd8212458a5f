"""bench/load's checks: every answer, every intent in the database, the lists, the webhooks, and on chain
(harness.audit)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any

from bench.load.measure import Intent, Merchant, Record, Rows, Sample
from bench.load.scenarios import Workload
from bench.load.stack import LoadStack
from harness import audit

# --- the checks ----------------------------------------------------------------------------------------


def read_rows(url: str, merchants: list[Merchant]) -> Rows:
    import sqlalchemy as sa

    ids = [m.merchant_id for m in merchants]
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    mine = sa.bindparam("ids", expanding=True)
    settlements: dict[str, list[Any]] = defaultdict(list)
    events: dict[str, list[Any]] = defaultdict(list)
    deliveries: dict[str, list[Any]] = defaultdict(list)
    try:
        with engine.connect() as conn:

            def rows(sql: str) -> Any:
                return conn.execute(sa.text(sql).bindparams(mine), {"ids": ids})

            intents = {
                r.id: r
                for r in rows(
                    "SELECT id, merchant_id, status, amount_atomic, tx_hash FROM intents WHERE merchant_id IN :ids"
                )
            }
            for r in rows(
                "SELECT intent_id, merchant_id, status, network, payer, pay_to, amount_atomic, tx_hash, created_at, "
                "finished_at FROM settlements WHERE merchant_id IN :ids"
            ):
                settlements[r.intent_id].append(r)
            for r in rows("SELECT id, merchant_id, type, intent_id, created_at FROM events WHERE merchant_id IN :ids"):
                events[r.intent_id].append(r)
            for r in rows(
                "SELECT event_id, endpoint_id, status, attempt_count FROM webhook_deliveries WHERE merchant_id IN :ids"
            ):
                deliveries[r.event_id].append(r)
    finally:
        engine.dispose()
    per_merchant = Counter(r.merchant_id for r in intents.values())
    return Rows(intents, settlements, events, deliveries, per_merchant)


def check_answers(samples: list[Sample]) -> list[str]:
    """Every request answered its expected status and body."""
    errors = Counter(f"{s.op}: {s.error}" for s in samples if s.error)
    example = {f"{s.op}: {s.error}": s.detail for s in samples if s.error}
    return [f"{n} x {what} (e.g. {example[what]})" for what, n in errors.most_common()]


def check_intent(intent: Intent, rows: Rows) -> list[str]:
    """One intent's end state against what its client saw."""
    row = rows.intents.get(intent.intent_id)
    if row is None:
        return ["created intent missing from the database"]
    found = []
    if row.merchant_id != intent.merchant.merchant_id or row.amount_atomic != intent.atomic:
        found.append("intent row has another merchant or amount")
    settlements = rows.settlements.get(intent.intent_id, [])
    events = Counter(e.type for e in rows.events.get(intent.intent_id, []))
    if intent.outcome == "paid":
        confirmed = [s for s in settlements if s.status == "confirmed"]
        if row.status != "paid" or (row.tx_hash or "").lower() != intent.tx_hash:
            found.append(f"paid intent is {row.status} in the database (or another tx_hash)")
        if len(settlements) != 1 or len(confirmed) != 1:
            found.append(f"paid intent has {len(settlements)} settlements, {len(confirmed)} confirmed")
        for s in confirmed:
            wanted = (intent.network, intent.buyer.lower(), intent.merchant.payout.lower(), intent.atomic)
            if (s.network, s.payer.lower(), s.pay_to.lower(), s.amount_atomic) != wanted:
                found.append("settlement network, payer, payee or amount differs from the payment")
        if events != Counter({"payment.completed": 1}):
            found.append(f"paid intent has events {dict(events)}")
    elif intent.outcome in ("cancelled", "pending"):
        if row.status != intent.outcome:
            found.append(f"{intent.outcome} intent is {row.status} in the database")
        if settlements or events:
            found.append(f"{intent.outcome} intent has {len(settlements)} settlements and events {dict(events)}")
    return found


def check_intents(record: Record, rows: Rows) -> list[str]:
    found: Counter[str] = Counter()
    for intent in record.intents.values():
        for problem in check_intent(intent, rows):
            found[problem] += 1
    created = Counter(i.merchant.merchant_id for i in record.intents.values())
    extra = sum(max(0, rows.per_merchant[m] - created[m]) for m in rows.per_merchant)
    if extra:
        found["intents in the database that no create answered (an idempotent retry created one?)"] += extra
    return [f"{n} x {what}" for what, n in found.items()]


def check_lists(record: Record) -> list[str]:
    """A merchant's list answers hold only intents of that merchant."""
    foreign = sum(
        1
        for merchant, ids in record.listed
        for intent_id in ids
        if intent_id in record.intents and record.intents[intent_id].merchant is not merchant
    )
    unknown = sum(1 for _, ids in record.listed for intent_id in ids if intent_id not in record.intents)
    problems = []
    if foreign:
        problems.append(f"{foreign} x another merchant's intent in a list answer")
    if unknown:
        problems.append(f"{unknown} x an intent in a list answer that no create answered")
    return problems


def check_chain(stack: LoadStack, record: Record, before: audit.Balances) -> list[str]:
    """On chain (harness.audit): each paid intent's transaction moved exactly its amount from its buyer to its
    merchant's payout wallet, once, and no transaction paid two intents; every buyer and payout wallet changed
    by exactly its paid sums (atomic units)."""
    paid = [
        audit.Paid(i.network, i.buyer, i.merchant.payout, i.atomic, i.tx_hash or None)
        for i in record.intents.values()
        if i.outcome == "paid"
    ]
    return audit.audit(stack.tokens(), paid, before)


def check_webhooks(stack: LoadStack, rows: Rows, received: list[tuple[str, float]]) -> list[str]:
    """Each event of a merchant with an endpoint: one delivery, succeeded in one attempt, received once; the
    others: no delivery."""
    subscribed = {m.merchant_id for m in stack.merchants if m.webhook_id}
    events = [e for evs in rows.events.values() for e in evs]
    got = Counter(event_id for event_id, _ in received)
    found: Counter[str] = Counter()
    for event in events:
        deliveries = rows.deliveries.get(event.id, [])
        if event.merchant_id not in subscribed:
            if deliveries or got[event.id]:
                found["a delivery of an event of a merchant without an endpoint"] += 1
            continue
        if [(d.status, d.attempt_count) for d in deliveries] != [("succeeded", 1)]:
            found[f"deliveries {[(d.status, d.attempt_count) for d in deliveries]} for one event"] += 1
        if got[event.id] != 1:
            found[f"event received {got[event.id]} times"] += 1
    known = {e.id for e in events}
    unknown = sum(n for event_id, n in got.items() if event_id not in known)
    if unknown:
        found["received webhooks of unknown events"] += unknown
    return [f"webhooks: {n} x {what}" for what, n in found.items()]


def check(stack: LoadStack, workload: Workload, balances_before: audit.Balances) -> tuple[list[str], Rows, list[Any]]:
    print("checking", flush=True)
    stack.wait_webhooks_settled(60)
    time.sleep(1.0)  # a delivery recorded as succeeded has been received; let the receiver's count settle
    rows = read_rows(stack.database.url, stack.merchants)
    received = stack.receiver.records(0)
    record = workload.record
    problems = check_answers(record.samples)
    problems += check_intents(record, rows)
    problems += check_lists(record)
    problems += check_chain(stack, record, balances_before)
    problems += check_webhooks(stack, rows, received)
    problems += stack.log_problems()
    return problems, rows, received
