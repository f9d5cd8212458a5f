"""What bench/pay drives: the runs (client threads POSTing /pay) and the in-process breakdown."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from bench import _common as common
from bench._common import BenchError
from bench.pay.measure import (
    STEP_ROWS,
    Call,
    Payment,
    RpcLog,
    RunConfig,
    RunResult,
    Sample,
    timed_chains,
)
from bench.pay.stack import Stack

# --- a run -------------------------------------------------------------------------------------------


def attribute(calls: list[Call], payments: list[Payment]) -> int:
    """Tie each recorded RPC call to its payment; returns the calls that could not be tied."""
    by_payer = {p.buyer.address.lower(): p for p in payments}
    by_tx = {p.tx_hash: p for p in payments if p.tx_hash}
    connections: dict[int, list[Call]] = defaultdict(list)
    for call in calls:
        connections[call.conn].append(call)
    lost = 0
    for conn_calls in connections.values():
        # A call that names no buyer or transaction (eth_chainId, eth_blockNumber, fees, nonce) belongs to
        # the payment last named on its connection while that payment is unfinished, else to the next one
        # named there (web3 asks eth_chainId before the eth_call that names the buyer).
        current: Payment | None = None
        pending: list[Call] = []
        for call in sorted(conn_calls, key=lambda c: c.t_in):
            owner = (by_payer.get(call.ident) or by_tx.get(call.ident)) if call.ident else None
            if owner is not None:
                owner.calls += [*pending, call]
                pending = []
                current = owner
            elif current is not None and call.t_in < (current.finished or current.t1):
                current.calls.append(call)
            else:
                pending.append(call)
        lost += len(pending)
    return lost


def run_config(stack: Stack, config: RunConfig, payments: list[Payment], warmup: list[Payment]) -> RunResult:
    print(f"- {config.label}: {config.clients} clients, {len(payments)} payments (+{len(warmup)} warm-up)", flush=True)
    stack.use_relayers(config.accounts, config.relayers)
    stack.create_intents(warmup + payments, f"{config.key}-{secrets.token_hex(3)}")
    if config.block_time:
        stack.set_block_time(config.block_time)
    try:
        # Warm every gunicorn worker and relayer on every chain (each builds its web3 clients lazily).
        stack.drive(warmup, max(config.clients, stack.workers))
        other = common.wait_for_quiet(stack.wait_idle)
        stack.proxy_records()  # drop the warm-up's calls
        meter = stack.cpu_groups()
        meter.start()
        seconds = stack.drive(payments, config.clients)
        used = meter.stop()
        calls = stack.proxy_records()
    finally:
        if config.block_time:
            stack.set_block_time(0)
    problems = stack.check(warmup + payments, config.label)
    errors = Counter(f"{c.method}: {c.error}" for c in calls if c.error)
    problems += [f"{config.label}: {n} x RPC error answer {what}" for what, n in errors.items()]
    lost = attribute(calls, payments)
    n = max(1, len(payments))
    cores = os.cpu_count() or 1
    result = RunResult(
        config=config,
        sent=payments,
        seconds=max(p.t1 for p in payments) - min(p.t0 for p in payments),
        cpu_ms={k: 1000 * v / n for k, v in used.items() if k != "machine"},
        machine_busy=used["machine"] / (seconds * cores),
        other_share=used["other"] / (seconds * cores),
        problems=problems,
        unattributed_calls=lost,
        busy_before=other,
    )
    settled = result.payments
    m = max(1, len(settled))
    for p in settled:
        for c in p.calls:
            side = "API" if p.created and c.t_in < p.created else "relayer"
            result.rpc_methods[f"{side}: {c.method}"] += 1 / m
    result.rpc_api = sum(len([c for c in p.calls if p.created and c.t_in < p.created]) for p in settled) / m
    result.rpc_relayer = sum(len([c for c in p.calls if p.created and c.t_in >= p.created]) for p in settled) / m
    print(
        f"    {result.rate:.1f} settlements/s; /pay p50 {result.ms(lambda p: p.latency, 50):.1f} ms, "
        f"p99 {result.ms(lambda p: p.latency, 99):.1f} ms; service p50 {result.ms(result.overhead, 50):.1f} ms; "
        f"problems: {len(problems)}",
        flush=True,
    )
    for problem in problems:
        print(f"    PROBLEM {problem}", flush=True)
    return result


class StepRecorder:
    """A backend.timing recorder: each step of submit_payment timed into `sample` under its row
    (wall seconds, RPC seconds and calls from `log`, and the step's wall-clock window). On entering the
    wait for the relayer it first runs `before_wait` (the relay half, in this process)."""

    def __init__(self, log: RpcLog) -> None:
        self.log = log
        self.sample: dict[str, tuple[float, float, int, float, float]] = {}
        self.before_wait: Callable[[], None] = lambda: None

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name == "wait_settled":
            self.before_wait()
        row = STEP_ROWS.get(name)  # None: a step that is no row (check_on_chain: its reads are rows)
        with contextlib.nullcontext() if row is None else self.step(row):
            yield

    def timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A step the bench calls itself (the relay half, the comparisons), timed the same way."""
        with self.step(name):
            return fn(*args)

    @contextlib.contextmanager
    def step(self, row: str) -> Iterator[None]:
        mark, window, started = self.log.mark(), time.time(), time.perf_counter()
        try:
            yield
        finally:
            self.sample[row] = (time.perf_counter() - started, *self.log.between(mark), window, time.time())
            self.log.note(row, mark)


# The relay half below follows relayer.tasks._settle (a fresh settlement: no pre-check) step by step;
# main() warns when its RPC calls per payment stop matching what the runs saw through the proxy.
def relay_in_process(stack: Stack, chain: Any, accounts: list[Any], settlement_id: str, rec: StepRecorder) -> None:
    """The relayer's job for one settlement, run here between /pay's enqueue and its wait (fresh app context,
    as the relayer's job has), then the /pay call woken as the relayer wakes it."""
    from backend.extensions import db
    from backend.intents.models import Intent
    from backend.rails.evm import relay
    from backend.rails.evm import watch as relay_watch
    from backend.settlement import flow, services
    from backend.settlement import models as st
    from backend.settlement.models import settlement_terms
    from backend.settlement.reconcile import finish_from_chain

    log = rec.log
    settlement = rec.timed("load settlement", services.get_settlement, settlement_id)
    if settlement.status != st.PENDING and rec.timed("pre-check", finish_from_chain, chain.network, settlement):
        raise BenchError("breakdown: the chain already decided a new settlement")
    rec.timed("intent check", db.session.get, Intent, settlement.intent_id)
    call = relay.transfer_call(chain, settlement_terms(settlement))
    rec.timed("code read again", chain.has_code, settlement.payer)
    rec.timed("latest block time", chain.block_timestamp, "latest")
    fee_fields = rec.timed("fees", relay.fees, chain)
    marks: dict[str, Any] = {}

    def before_broadcast(tx_hash: str, address: str, nonce: int | None) -> None:
        marks["b0"], marks["m0"], marks["w0"] = time.perf_counter(), log.mark(), time.time()
        services.mark_submitted(settlement_id, tx_hash, address, relay_nonce=nonce)
        marks["b1"], marks["m1"], marks["w1"] = time.perf_counter(), log.mark(), time.time()

    mark, started, w_start = log.mark(), time.perf_counter(), time.time()
    tx_hash = relay.send(stack.redis, chain, accounts, call, fee_fields, before_broadcast)
    ended, end_mark, w_end = time.perf_counter(), log.mark(), time.time()
    sample = rec.sample
    sample["lease, nonce, fees, sign"] = (marks["b0"] - started, *log.between(mark, marks["m0"]), w_start, marks["w0"])
    sample["mark submitted"] = (
        marks["b1"] - marks["b0"],
        *log.between(marks["m0"], marks["m1"]),
        marks["w0"],
        marks["w1"],
    )
    sample["broadcast"] = (ended - marks["b1"], *log.between(marks["m1"], end_mark), marks["w1"], w_end)
    log.note("lease, nonce, fees, sign", mark, marks["m0"])
    log.note("broadcast", marks["m1"], end_mark)
    receipt = rec.timed("receipt", relay_watch.wait_receipt, chain, tx_hash, 60)
    if receipt is None or receipt.get("status") != 1:
        raise BenchError(f"breakdown: transaction {tx_hash} did not succeed")
    if hasattr(relay_watch, "wait_confirmations"):
        block = int(receipt["blockNumber"])
        if not rec.timed("confirmations", relay_watch.wait_confirmations, chain, block, 60):
            raise BenchError(f"breakdown: transaction {tx_hash} did not reach its confirmations")
    rec.timed(
        "complete",
        lambda: (services.get_settlement(settlement_id), services.complete_settlement(settlement_id, tx_hash)),
    )
    flow.notify_settled(stack.redis, settlement_id)


BREAKDOWN_QUEUE = "bench-breakdown"  # /pay's job goes here, where no relayer listens: the bench relays itself


def breakdown(
    stack: Stack, payments: list[Payment], warm: int
) -> tuple[dict[str, list[Sample]], dict[str, Counter[str]], list[str]]:
    """Pay each payment in this process through the service's own submit_payment, its steps timed through
    backend.timing, with the relayer's half run in between by relay_in_process."""
    from dataclasses import replace

    import sqlalchemy as sa
    from eth_account import Account

    from backend import timing
    from backend.app import create_app
    from backend.chains.registry import ChainRegistry
    from backend.config import Settings
    from backend.extensions import db
    from backend.intents.models import Intent
    from backend.rails.evm.terms import parse_evm_payload
    from backend.settlement import flow, intake
    from backend.settlement import models as st
    from payintent.eip3009 import domain_of, recover_authorizer

    print(f"- breakdown: {len(payments) - warm} payments (+{warm} warm-up) paid in-process, one at a time", flush=True)
    stack.create_intents(payments, f"breakdown-{secrets.token_hex(3)}")
    chains_file = stack.chains_file[max(stack.chains_file)]  # through the proxy (unless --no-proxy)
    registry = ChainRegistry.load(chains_file)
    settings = replace(
        Settings.from_env(),
        database_url=stack.database.url,
        redis_url=stack.redis_url,
        chains_file=chains_file,
        log_level="WARNING",
    )
    app = create_app(settings, chains=registry)
    log = RpcLog()
    chains = timed_chains(registry, log)
    accounts = {n: [Account.from_key(k) for k in keys] for n, keys in stack.relay_keys.items()}
    steps: dict[str, list[Sample]] = defaultdict(list)
    raw: dict[str, list[tuple[float, float, int, float, float]]] = defaultdict(list)
    stack.proxy_records()  # start with an empty record

    def relay(p: Payment, rec: StepRecorder) -> None:
        with app.app_context():  # the relayer's job runs in a fresh app context
            settlement_id = db.session.execute(
                sa.select(st.Settlement.id)
                .where(st.Settlement.intent_id == p.intent_id, st.Settlement.status == st.PENDING)
                .order_by(st.Settlement.created_at.desc())
            ).scalar_one()
            relay_in_process(stack, chains[p.network], accounts[p.network], settlement_id, rec)
            db.session.remove()

    for index, p in enumerate(payments):
        rec = StepRecorder(log)
        rec.before_wait = lambda p=p, rec=rec: relay(p, rec)
        payload = p.body["payment_signature"]["payload"]
        try:
            p.t0 = time.time()
            with app.app_context(), timing.recording(rec):
                answer = flow.submit_payment(
                    stack.merchant_id,
                    p.intent_id,
                    p.body["payment_signature"],
                    registry,
                    stack.redis,
                    queue_name=BREAKDOWN_QUEUE,
                )
                intent = db.session.get(Intent, p.intent_id)
                assert intent is not None
                requirement = next(r for r in intent.payment_requirements if r["network"] == p.network)
                db.session.remove()
            p.t1 = time.time()
            p.status, p.tx_hash = 200, str(answer["tx_hash"]).lower()
            # Comparisons, after the payment (not counted in the totals).
            auth = parse_evm_payload(payload)
            rec.timed("  of it: signature", recover_authorizer, domain_of(requirement), auth.raw)
        except Exception as exc:  # a transient RPC error, say: report it, keep going
            p.status, p.code = 0, f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"    breakdown payment {index} failed: {p.code}", flush=True)
            continue
        if index >= warm:
            for name, value in rec.sample.items():
                raw[name].append(value)
    with app.app_context():
        db.engine.dispose()
    for network in stack.networks:  # the settlements /pay pushed for a relayer that never came
        stack.redis.delete(intake.list_key(BREAKDOWN_QUEUE, network))
    calls = stack.proxy_records()
    for name, values in raw.items():
        for wall, provider, count, w0, w1 in values:
            chain = sum(c.seconds for c in calls if w0 <= c.t_in <= w1)
            steps[name].append((wall, provider, count, chain))
    problems = stack.check(payments, "breakdown")
    problems += [f"breakdown: {p.code}" for p in payments if p.status != 200 and p.code]
    for problem in problems:
        print(f"    PROBLEM {problem}", flush=True)
    return steps, dict(log.methods), problems


def configs(args: argparse.Namespace) -> list[RunConfig]:
    bt = args.block_time
    every = [
        RunConfig("serial", "4 accounts, 4 relayers, 1 client", 4, 4, 1, args.serial_payments),
        RunConfig("acc4", "4 accounts, 4 relayers", 4, 4, args.clients, args.payments),
        RunConfig(
            "blocks", f"4 accounts, 4 relayers, {bt} s blocks", 4, 4, args.block_clients, args.block_payments, bt
        ),
        RunConfig("acc1-rel4", "1 account, 4 relayers", 1, 4, args.clients, args.payments),
        RunConfig("acc1", "1 account, 1 relayer", 1, 1, args.clients, args.payments),
    ]
    return [c for c in every if c.key in args.runs]
