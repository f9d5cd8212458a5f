"""What bench/load measures: the HTTP client, what the clients did, and the numbers (ops/s, latency, CPU)."""

from __future__ import annotations

import http.client
import os
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from bench._common import HOST, pct
from bench.pay.measure import ts
from bench.webhooks.measure import clock_offset

SECTION = "## Load: many merchants on PostgreSQL"
INTENTS = "/api/v1/x402/intents"
PAY = "/api/v1/x402/pay"
WEBHOOKS = "/api/v1/webhooks"
WEBHOOK_EVENTS = ["payment.completed", "payment.failed", "payment.expired"]
MIN_ATOMIC, MAX_ATOMIC = 10_000, 20_000_000  # 0.01 to 20 USDC per intent
PAGE = 20
OPS = ("create", "replay", "get", "list", "cancel", "pay")
OP_NAMES = {
    "create": "create `POST /intents` (Idempotency-Key)",
    "replay": "create again, same key (replayed)",
    "get": "read `GET /intents/{id}`",
    "list": f"list `GET /intents?limit={PAGE}&offset=…` (page 1, and 2 when there is one)",
    "cancel": "cancel `DELETE /intents/{id}`",
    "pay": "pay `POST /x402/pay` (answers once settled)",
}
EXPECTED = {"create": 201, "replay": 201, "get": 200, "list": 200, "cancel": 200, "pay": 200}


# --- the HTTP client ---------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict[str, str]


def call(
    port: int, method: str, path: str, token: str, body: Any = None, headers: dict[str, str] | None = None
) -> Answer:
    """One request on a new connection (gunicorn's sync workers close it anyway); JSON numbers as Decimal."""
    from backend.jsonio import dumps, strict_loads

    conn = http.client.HTTPConnection(HOST, port, timeout=120)
    try:
        sent = {"Authorization": f"Bearer {token}", **(headers or {})}
        payload = None
        if body is not None:
            payload = dumps(body)
            sent["Content-Type"] = "application/json"
        conn.request(method, path, body=payload, headers=sent)
        response = conn.getresponse()
        raw = response.read()
        received = {k.lower(): v for k, v in response.getheaders()}
        try:
            return Answer(response.status, strict_loads(raw), received)
        except ValueError:
            return Answer(response.status, raw.decode("utf-8", "replace")[:300], received)
    finally:
        conn.close()


# --- what the clients did ----------------------------------------------------------------------------


@dataclass
class Merchant:
    index: int
    merchant_id: str
    api_key: str
    payout: str
    webhook_id: str | None = None


@dataclass
class Intent:
    merchant: Merchant
    intent_id: str
    atomic: int
    order_id: str
    outcome: str = "pending"  # pending, paid, cancelled, or unknown (its pay or cancel went wrong)
    network: str = ""
    buyer: str = ""
    tx_hash: str = ""
    pay_started: float = 0.0  # time.monotonic() when /pay was sent
    pay_seconds: float = 0.0


@dataclass
class Sample:
    op: str
    started: float  # time.monotonic()
    seconds: float  # 0: not a request (a wrong body found in an answer already timed)
    error: str | None  # what went wrong, short (counted by kind)
    detail: str = ""  # an example of it


@dataclass
class Record:
    """Everything the client threads did, shared between them."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    samples: list[Sample] = field(default_factory=list)
    intents: dict[str, Intent] = field(default_factory=dict)
    listed: list[tuple[Merchant, list[str]]] = field(default_factory=list)

    def add(self, sample: Sample) -> None:
        with self.lock:
            self.samples.append(sample)

    def created(self, intent: Intent) -> None:
        with self.lock:
            self.intents[intent.intent_id] = intent

    def saw_listed(self, merchant: Merchant, ids: list[str]) -> None:
        with self.lock:
            self.listed.append((merchant, ids))


@dataclass
class Mix:
    replay: float
    list: float
    pay: float
    cancel: float

    def describe(self) -> str:
        leave = 1 - self.pay - self.cancel
        return (
            f"per iteration: create, read; create again with the same key {100 * self.replay:.0f}%; list "
            f"{100 * self.list:.0f}% (page 2 too when there is one); then pay {100 * self.pay:.0f}%, cancel "
            f"{100 * self.cancel:.0f}% (each followed by a read), leave pending {100 * leave:.0f}%"
        )


@dataclass
class Rows:
    """The end state in the database, for the merchants of the run."""

    intents: dict[str, Any]
    settlements: dict[str, list[Any]]
    events: dict[str, list[Any]]
    deliveries: dict[str, list[Any]]  # by event id
    per_merchant: Counter[str]


# --- numbers -------------------------------------------------------------------------------------------


@dataclass
class OpStats:
    name: str
    count: int
    rate: float
    p50_ms: float
    p99_ms: float
    errors: int


def op_stats(samples: list[Sample], seconds: float) -> list[OpStats]:
    """Per operation over the measured samples (errors: answers with a wrong status or body)."""
    by_op: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_op[s.op].append(s)
    stats = []
    for op in OPS:
        timed = [s.seconds for s in by_op[op] if s.seconds > 0]
        errors = sum(1 for s in by_op[op] if s.error)
        stats.append(
            OpStats(
                OP_NAMES[op], len(timed), len(timed) / seconds, 1000 * pct(timed, 50), 1000 * pct(timed, 99), errors
            )
        )
    timed = [s.seconds for s in samples if s.seconds > 0]
    errors = sum(1 for s in samples if s.error)
    stats.append(
        OpStats(
            "**all requests**", len(timed), len(timed) / seconds, 1000 * pct(timed, 50), 1000 * pct(timed, 99), errors
        )
    )
    return stats


def webhook_stats(
    rows: Rows, received: list[tuple[str, float]], subscribed: set[str], start: float, end: float
) -> OpStats:
    """Deliveries of events recorded during the measured part: event recorded -> received (one clock); errors:
    events of merchants with an endpoint not received exactly once."""
    offset = clock_offset()
    got = Counter(event_id for event_id, _ in received)
    first: dict[str, float] = {}
    for event_id, at in received:
        first.setdefault(event_id, at)
    latencies = []
    errors = 0
    for event in (e for evs in rows.events.values() for e in evs if e.merchant_id in subscribed):
        recorded = (ts(event.created_at) or 0.0) - offset
        if not start <= recorded < end:
            continue
        errors += got[event.id] != 1
        if event.id in first:
            latencies.append(first[event.id] - recorded)
    return OpStats(
        "webhook delivery (event recorded → received)",
        len(latencies),
        len(latencies) / (end - start),
        1000 * pct(latencies, 50),
        1000 * pct(latencies, 99),
        errors,
    )


def table(stats: list[OpStats], webhooks: OpStats) -> str:
    rows = [
        "| operation | requests | ops/s | p50 ms | p99 ms | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in [*stats, webhooks]:
        rows.append(f"| {s.name} | {s.count} | {s.rate:.1f} | {s.p50_ms:.1f} | {s.p99_ms:.1f} | {s.errors} |")
    return "\n".join(rows)


def cpu_table(used: dict[str, float], seconds: float, requests: int) -> str:
    cores = os.cpu_count() or 1
    names = [k for k in used if k != "machine"]
    rows = [
        "| " + " | ".join(["", *names, "machine busy"]) + " |",
        "| " + " | ".join(["---", *(["---:"] * (len(names) + 1))]) + " |",
        "| CPU ms per request | " + " | ".join(f"{1000 * used[k] / max(1, requests):.2f}" for k in names) + " | |",
        "| share of the machine | "
        + " | ".join(f"{100 * used[k] / (seconds * cores):.0f}%" for k in names)
        + f" | {100 * used['machine'] / (seconds * cores):.0f}% |",
    ]
    return "\n".join(rows)
