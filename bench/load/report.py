"""bench/load's printed tables and its section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench import _common as common
from bench._common import pct
from bench.load.measure import (
    MAX_ATOMIC,
    MIN_ATOMIC,
    SECTION,
    WEBHOOK_EVENTS,
    OpStats,
    Record,
    Rows,
    cpu_table,
    op_stats,
    table,
    webhook_stats,
)
from bench.load.scenarios import Workload, _amount
from bench.load.stack import LoadStack
from bench.pay.measure import ts
from bench.webhooks.measure import clock_offset

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
    offset = clock_offset()
    phases: list[tuple[float, float, float]] = []
    for intent in record.intents.values():
        confirmed = [s for s in rows.settlements.get(intent.intent_id, []) if s.status == "confirmed"]
        if intent.outcome != "paid" or not confirmed or not start <= intent.pay_started < end:
            continue
        claimed = (ts(confirmed[0].created_at) or 0.0) - offset
        paid = (ts(confirmed[0].finished_at) or 0.0) - offset
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
        "reconciler), the webhook receiver of bench.webhooks, 3 Anvil chains (automine), Redis, PostgreSQL; "
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
