"""bench/pay's chain-speed scenarios (issue [3/5]): floods of /pay at 2 s blocks and on automine, next to the peer.

Each scenario drives POST /pay from many client threads (intents created and authorizations signed
beforehand, one fresh funded buyer per payment), measures settlements/s (payments confirmed on chain over the
time from the first /pay sent to the last intent marked paid), the /pay latency of those answered 200 and the
CPU per settlement of the service's processes and the chains (drain included), and runs the peer
(``bench.pay.peer``) with the same chain mode and concurrency. At 2 s blocks a side reader GETs intents of
the flood throughout. A client gives up on /pay after ``pay_cap`` seconds (the payment is counted
unfinished, not waited for); afterwards the run waits until the service has settled or given up on every
payment, then checks each one on chain with ``harness.audit``: at most one settlement confirmed per intent, a
200 answer confirmed with its tx hash, every transfer exactly once, the balances to the atomic unit.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import _common as common
from bench._common import pct
from bench.pay.measure import AMOUNT_ATOMIC, FUND_ATOMIC, INTENTS, Payment, ts
from bench.pay.peer import PeerResult
from bench.pay.stack import Stack, payout_of
from harness import audit

CPU_STACK = ("api", "relayers", "postgres", "redis", "anvil", "stack")  # the service's processes and the chains


@dataclass(frozen=True)
class Scenario:
    key: str
    what: str
    clients: int
    payments: int  # default size
    block_time: int  # 0: automine
    aim: str
    aim_rate: float  # settlements/s
    aim_p50_s: float | None = None
    aim_cpu_ms: float | None = None
    all_settled: bool = False  # every payment answered 200 within the run
    dev: bool = False  # `payintent dev` (make run's stack) instead of bench/pay's
    settle: bool = False  # through the facilitator API's settle (a resource server's call), not /pay


SCENARIOS = (
    Scenario("blocks2-32", "2 s blocks, 32 concurrent payers", 32, 96, 2, "≥ 18/s, /pay p50 ≤ 2 s", 18, 2.0),
    Scenario("blocks2-256", "2 s blocks, 256 concurrent payers", 256, 256, 2, "≥ 60/s, every payment settled", 60,
             all_settled=True),
    Scenario("automine-32", "automine, 32 concurrent payers", 32, 200, 0, "≥ 100/s, ≤ 18 CPU ms per settlement",
             100, aim_cpu_ms=18),
    Scenario("makerun-32", "`payintent dev` (make run) defaults, 2 s blocks, 32 agents", 32, 96, 2,
             "≥ 12/s, /pay p50 ≤ 4 s", 12, 4.0, dev=True),
    Scenario("facilitator-32", "2 s blocks, 32 concurrent settle calls to the facilitator API", 32, 96, 2,
             "none set ([4/5]: beside the peer; the closed loop's bound is 16/s)", 0, settle=True),
)  # fmt: skip
BY_KEY = {s.key: s for s in SCENARIOS}
READER_AIM_MS = 100.0


def help_text() -> str:
    return "; ".join(f"{s.key}: {s.what}, {s.payments} payments, aim {s.aim}" for s in SCENARIOS)


@dataclass
class Outcome:
    scenario: Scenario
    sent: list[Payment]
    problems: list[str] = field(default_factory=list)
    cpu_ms: float | None = None  # CPU ms per settlement, the service's processes and the chains
    reads: list[float] = field(default_factory=list)  # side reader: seconds per GET
    read_errors: int = 0
    late: int = 0  # answered other than 200 (or not within the cap), settled afterwards
    unpaid: int = 0  # never settled (the service gave up, or still in flight when the drain gave up)
    drain_s: float = 0.0
    peer: PeerResult | None = None

    @property
    def ok(self) -> list[Payment]:
        return [p for p in self.sent if p.status == 200 and p.tx_hash]

    @property
    def unfinished(self) -> int:
        return len(self.sent) - len(self.ok)

    @property
    def settled(self) -> list[Payment]:
        """Confirmed on chain, whatever /pay answered (a payment the client gave up on may settle later)."""
        return [p for p in self.sent if p.finished is not None]

    @property
    def rate(self) -> float:
        """Settlements per second: confirmed payments / (the last one marked paid - the first /pay sent)."""
        settled = self.settled
        if not settled:
            return 0.0
        return len(settled) / max(1e-9, max(p.finished or 0.0 for p in settled) - min(p.t0 for p in self.sent))

    @property
    def p50_s(self) -> float:
        return pct([p.latency for p in self.ok], 50)

    @property
    def reads_p99_ms(self) -> float:
        return 1000 * pct(self.reads, 99)

    def verdict(self) -> tuple[bool, list[str]]:
        """(met, the figures that missed)."""
        s, missed = self.scenario, []
        if self.rate < s.aim_rate:
            missed.append(f"{self.rate:.1f}/s < {s.aim_rate:g}/s")
        if s.aim_p50_s is not None and (not self.ok or self.p50_s > s.aim_p50_s):
            missed.append(f"p50 {self.p50_s:.2f} s > {s.aim_p50_s:g} s")
        if s.aim_cpu_ms is not None and (self.cpu_ms is None or self.cpu_ms > s.aim_cpu_ms):
            missed.append(f"{self.cpu_ms or 0:.1f} CPU ms > {s.aim_cpu_ms:g}")
        if s.all_settled and self.unfinished:
            missed.append(f"{self.unfinished} of {len(self.sent)} not settled within /pay")
        return not missed, missed


# --- the side reader ---------------------------------------------------------------------------------


class SideReader(threading.Thread):
    """GET /api/v1/x402/intents/{id} of random intents of the flood, one at a time, every `pause` s."""

    def __init__(self, stack: Stack, ids: list[str], pause: float = 0.05, timeout: float = 30) -> None:
        super().__init__(daemon=True)
        self.stack, self.ids, self.pause, self.timeout = stack, ids, pause, timeout
        self.stopping = threading.Event()
        self.seconds: list[float] = []
        self.errors = 0

    def run(self) -> None:
        from bench import api as bench_api

        while not self.stopping.is_set():
            path = f"{INTENTS}/{random.choice(self.ids)}"
            started = time.perf_counter()
            try:
                status, _ = bench_api.request(
                    self.stack.api_port, "GET", path, self.stack.api_key, timeout=self.timeout
                )
            except OSError:
                status = 0
            self.seconds.append(time.perf_counter() - started)
            self.errors += status != 200
            self.stopping.wait(self.pause)

    def stop(self) -> None:
        self.stopping.set()
        self.join(self.timeout + 5)


# --- a scenario on a stack -----------------------------------------------------------------------------


def run_scenario(
    stack: Stack, scenario: Scenario, payments: list[Payment], warmup: list[Payment], cpu: common.CpuGroups,
    drain_cap: float,
) -> Outcome:  # fmt: skip
    """Warm up (automine), set the block time, flood /pay from scenario.clients threads (a side reader on at
    2 s blocks), then drain and audit."""
    print(f"- {scenario.key}: {scenario.what}: {len(payments)} payments (+{len(warmup)} warm-up)", flush=True)
    outcome = Outcome(scenario, payments)
    if scenario.settle:
        stack.prepare_settles(warmup + payments)
    else:
        stack.create_intents(warmup + payments, f"{scenario.key}-{random.getrandbits(24):06x}")
    if warmup:
        stack.drive(warmup, min(len(warmup), max(4, stack.workers)))
        outcome.problems += drain_and_audit(stack, warmup, f"{scenario.key} warm-up", drain_cap, Outcome(scenario, []))
    stack.proxy_records()
    reader = SideReader(stack, [p.intent_id for p in payments]) if scenario.block_time else None
    if scenario.block_time:
        stack.set_block_time(scenario.block_time)
    try:
        cpu.start()
        if reader:
            reader.start()
        stack.drive(payments, scenario.clients)
        if reader:
            reader.stop()
        outcome.problems += drain_and_audit(stack, payments, scenario.key, drain_cap, outcome)
        used = cpu.stop()  # the drain's too: what the payments given up on cost is still theirs
    finally:
        if scenario.block_time:
            stack.set_block_time(0)
    stack.proxy_records()
    if reader:
        outcome.reads, outcome.read_errors = reader.seconds, reader.errors
    settled = max(1, len(outcome.settled))
    outcome.cpu_ms = 1000 * sum(v for k, v in used.items() if k in CPU_STACK) / settled
    reads = f"; GET p99 {outcome.reads_p99_ms:.0f} ms ({len(outcome.reads)} reads)" if reader else ""
    print(
        f"    {outcome.rate:.1f} settlements/s; /pay p50 {outcome.p50_s:.2f} s; unfinished {outcome.unfinished} "
        f"(settled later {outcome.late}, unpaid {outcome.unpaid}); {outcome.cpu_ms:.1f} CPU ms per settlement"
        f"{reads}; problems: {len(outcome.problems)}",
        flush=True,
    )
    groups = ", ".join(f"{k} {1000 * v / settled:.1f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]))
    print(f"    CPU ms per settlement by process group: {groups}", flush=True)
    for problem in outcome.problems:
        print(f"    PROBLEM {problem}", flush=True)
    return outcome


def drain(stack: Stack, payments: list[Payment], cap: float, quiet: float = 20) -> float:
    """Wait until every intent is paid, or nothing changed in the settlements for `quiet` s with none pending or
    submitted (a request the client gave up on may still sit in gunicorn's backlog: it would show as a change),
    at most `cap` s. Returns the seconds waited."""
    started = time.monotonic()
    last: tuple[Any, ...] = ()
    changed = started
    ids = [p.intent_id for p in payments]
    while True:
        settlements, intents, _ = stack.settlement_rows(ids)
        paid = sum(1 for i in intents.values() if i.status == "paid")
        states = Counter(r.status for rows in settlements.values() for r in rows)
        now = time.monotonic()
        seen = (paid, tuple(sorted(states.items())))
        if seen != last:
            last, changed = seen, now
        in_flight = states.get("pending", 0) + states.get("submitted", 0)
        if paid == len(ids) or (not in_flight and now - changed >= quiet) or now - started >= cap:
            return now - started
        time.sleep(1.0)


def drain_and_audit(stack: Stack, payments: list[Payment], what: str, cap: float, outcome: Outcome) -> list[str]:
    """After a flood: wait for the service (drain), then check every payment, answered or not: at most one
    confirmed settlement per intent, a 200 answer confirmed with its tx hash, one payment.completed event per
    paid intent, and on chain (harness.audit) each confirmed settlement moved its payment exactly once and the
    buyers' and the merchant's balances add up to the atomic unit."""
    if not payments:
        return []
    outcome.drain_s = drain(stack, payments, cap)
    settlements, intents, events = stack.settlement_rows([p.intent_id for p in payments])
    counts: Counter[str] = Counter()
    paid: list[audit.Paid] = []
    for p in payments:
        rows = settlements.get(p.intent_id, [])
        confirmed = [r for r in rows if r.status == "confirmed"]
        intent = intents.get(p.intent_id)
        for r in rows:
            if r.status in ("pending", "submitted"):
                counts[f"settlement still {r.status} after the drain ({outcome.drain_s:.0f} s)"] += 1
        paid += [audit.Paid(p.network, p.buyer.address, payout_of(stack, p.network), AMOUNT_ATOMIC, r.tx_hash)
                 for r in confirmed]  # fmt: skip
        if len(confirmed) > 1:
            counts[f"{len(confirmed)} settlements confirmed for one intent"] += 1
        if p.intent_id in stack.paid_intents:
            counts["intent paid in an earlier run"] += 1
        stack.paid_intents.add(p.intent_id)
        if confirmed:
            row = confirmed[0]
            p.created, p.submitted, p.finished = ts(row.created_at), ts(row.submitted_at), ts(row.finished_at)
            if intent is None or intent.status != "paid" or (intent.tx_hash or "").lower() != row.tx_hash.lower():
                counts["intent not paid with its confirmed settlement's tx"] += 1
            if events[p.intent_id] != 1:
                counts[f"{events[p.intent_id]} payment.completed events"] += 1
            if row.payer.lower() != p.buyer.address.lower() or row.network != p.network:
                counts["settlement payer or network differs"] += 1
            if (row.tx_hash or "").lower() in stack.tx_hashes:
                counts["transaction reused by two settlements"] += 1
            stack.tx_hashes.add((row.tx_hash or "").lower())
        if p.status == 200 and p.tx_hash:
            if len(confirmed) != 1 or (confirmed[0].tx_hash or "").lower() != p.tx_hash:
                counts["answered 200 but not confirmed with its tx hash"] += 1
        elif confirmed:
            outcome.late += 1
        else:
            outcome.unpaid += 1
    problems = [f"{what}: {n} x {kind}" for kind, n in counts.items()]
    before = {(p.network, p.buyer.address): FUND_ATOMIC for p in payments}
    before.update({(n, payout_of(stack, n)): stack.expected_payout[n] for n in stack.networks})
    for item in paid:
        stack.expected_payout[item.network] += item.atomic
    problems += [f"{what}: {problem}" for problem in audit.audit(stack.tokens(), paid, before)]
    return problems


# --- make run's stack ------------------------------------------------------------------------------------


def dev_bench_stack(dev: Any, workdir: Path, procs: common.ProcessSet) -> Stack:
    """bench/pay's Stack over a running ``payintent dev`` (harness.dev.DevStack): its API and demo merchant, its
    devnet's chains (straight to Anvil), its SQLite database and Redis, for create_intents/fund/drive and the
    audit. The payout addresses are read from an intent; the merchant's balances now are the baseline."""
    from redis import Redis

    stack = Stack(workdir, procs, workers=2)
    stack.api_port = int(dev.base_url.rsplit(":", 1)[1])
    stack.api_key = dev.api_key
    stack.pay_timeout = 90
    state = json.loads((dev.var_dir / "devnet" / "state.json").read_text())
    stack.deployer_key = state["deployer"]["private_key"]
    stack.anvil_pids = [int(n["pid"]) for n in state["networks"].values()]
    doc = json.loads(Path(dev.demo["chains_file"]).read_text())
    networks = [n for n in doc["networks"] if n.get("kind", "evm") == "evm"]
    stack.networks = [n["network"] for n in networks]
    stack.rpc_url = {n["network"]: n["rpc_url"] for n in networks}
    stack.usdc = {n["network"]: n["usdc_address"] for n in networks}
    stack.database = SimpleNamespace(url=f"sqlite:///{dev.var_dir / 'payintent.db'}")
    stack.redis_url = f"unix://{dev.var_dir / 'redis.sock'}"
    stack.redis = Redis.from_url(stack.redis_url)
    created = dev.create_intent(0.01)
    stack.payout = {r["network"]: r["payTo"] for r in created["payment_requirements"]}
    for network in stack.networks:
        stack.expected_payout[network] = stack.token_balance(network, payout_of(stack, network))
    return stack


def dev_cpu(dev: Any) -> common.CpuGroups:
    """CPU of `payintent dev` and everything it started (API, worker, relayer, Redis, the devnet's chains)."""
    return common.CpuGroups({"stack": lambda: common.process_tree(dev.process.pid)}, "client")


def peer_key(scenario: Scenario, n: int) -> tuple[int, int, int]:
    return (n, scenario.clients, scenario.block_time)
