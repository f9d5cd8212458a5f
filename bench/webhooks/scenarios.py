"""What bench/webhooks drives: the runs (backlog, stream, latency), measured again when disturbed, and the
in-process breakdown of one delivery."""

from __future__ import annotations

import argparse
import cProfile
import signal
import time
from collections.abc import Callable
from typing import Any

from bench import _common as common
from bench._common import BenchError
from bench.webhooks.measure import EVENT_TYPE, Breakdown, Profile, RunResult, Step
from bench.webhooks.stack import Stack

# --- the in-process breakdown -----------------------------------------------------------------------


STEPS = (
    ("claim", "`services.claim_due`: pick a due delivery (FOR UPDATE SKIP LOCKED), lease it, load it, COMMIT"),
    ("sign", "`signature_headers` (two HMAC-SHA256)"),
    ("post", "`transport.post`: resolve, connect (or reuse), POST, read the answer"),
    ("record", "`services.record_attempt`: conditional UPDATE of the delivery, INSERT of the attempt, COMMIT"),
    ("empty claim", "`services.claim_due` when nothing is due (what a woken sender with no work does)"),
)
IN_DELIVERY = ("claim", "sign", "post", "record")


def breakdown(stack: Stack, deliveries: int, profiled: int, rq_jobs: int) -> Breakdown:
    """deliver_one's steps, one delivery at a time, in this process (the workers are stopped)."""
    from sqlalchemy import event as sa_event

    from backend import clock
    from backend.events.services import record_event
    from backend.extensions import db
    from backend.webhooks import services, transport
    from payintent.webhooks import signature_headers

    steps = {name: Step(name, what) for name, what in STEPS}
    statements = [0]

    def count_statement(*_: Any) -> None:
        statements[0] += 1

    def one(timed: bool) -> None:
        def step(name: str, fn: Callable[[], Any]) -> Any:
            s0, w0, c0 = statements[0], time.perf_counter(), time.thread_time()
            out = fn()
            if timed:
                steps[name].wall.append(time.perf_counter() - w0)
                steps[name].cpu.append(time.thread_time() - c0)
                steps[name].statements += statements[0] - s0
            return out

        claimed = step("claim", lambda: services.claim_due(clock.now()))
        if claimed is None:
            raise BenchError("breakdown: nothing was due")
        attempted_at = clock.now()
        body = claimed.payload.encode("utf-8")
        stamp = int(attempted_at.timestamp())
        headers = step("sign", lambda: signature_headers(claimed.secret, claimed.event_id, body, stamp))
        result = step("post", lambda: transport.post(claimed.url, body, headers, allow_private=True, deadline=10.0))
        if not result.succeeded:
            raise BenchError(f"breakdown: the receiver answered {result.status_code} {result.error}")
        step("record", lambda: services.record_attempt(claimed, attempted_at, result))

    def empty(timed: bool) -> None:
        s0, w0, c0 = statements[0], time.perf_counter(), time.thread_time()
        if services.claim_due(clock.now()) is not None:
            raise BenchError("breakdown: a delivery was due")
        if timed:
            steps["empty claim"].wall.append(time.perf_counter() - w0)
            steps["empty claim"].cpu.append(time.thread_time() - c0)
            steps["empty claim"].statements += statements[0] - s0

    stack.idle()
    warm = 20
    for i in range(deliveries + profiled + warm):
        record_event(stack.merchant_id, EVENT_TYPE, stack.data)
        if i % 100 == 99:
            db.session.commit()
    db.session.commit()
    engine = db.engine
    sa_event.listen(engine, "before_cursor_execute", count_statement)
    try:
        for _ in range(warm):  # the pool, the statement cache, the receiver's connection
            one(False)
        for _ in range(deliveries):
            one(True)
        profiler = cProfile.Profile(time.process_time)
        c0 = time.process_time()
        profiler.enable()
        for _ in range(profiled):
            one(False)
        profiler.disable()
        profile = Profile.of(profiler, profiled, time.process_time() - c0)
        for _ in range(warm):
            empty(False)
        for _ in range(deliveries):
            empty(True)
    finally:
        sa_event.remove(engine, "before_cursor_execute", count_statement)
    result = Breakdown(deliveries, list(steps.values()), profile)
    if rq_jobs:
        result.rq_jobs = rq_jobs
        result.rq_wall_ms, result.rq_cpu_ms, result.rq_profile = rq_job_cost(stack, rq_jobs)
    return result


def rq_job_cost(stack: Stack, jobs: int) -> tuple[float, float, Profile]:
    """Wall and CPU ms per wake-up job run by an RQ SimpleWorker in this process, on the worker's path:
    dequeue, RQ's bookkeeping, the app context, the wake key's DELETE and the dispatcher's poke (a
    dispatcher without threads here). Half the jobs are timed, the other half profiled."""
    from rq import Queue, SimpleWorker

    from backend.queueing import set_job_app
    from backend.webhooks.tasks import WEBHOOK_QUEUE, Dispatcher

    queue = Queue(WEBHOOK_QUEUE, connection=stack.redis)
    queue.empty()
    dispatcher = Dispatcher(stack.app, 0).start()
    set_job_app(stack.app)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # RQ installs its own
    try:

        def burst(count: int) -> None:
            for _ in range(count):
                queue.enqueue(
                    "backend.webhooks.tasks.deliver_webhooks", result_ttl=0, failure_ttl=3600, job_timeout=3600
                )
            worker = SimpleWorker([queue], connection=stack.redis)
            worker.work(burst=True, with_scheduler=False, logging_level="WARNING")

        burst(5)  # warm
        half = max(1, jobs // 2)
        w0, c0 = time.perf_counter(), time.process_time()
        burst(half)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        profiler = cProfile.Profile(time.process_time)
        c1 = time.process_time()
        profiler.enable()
        burst(half)
        profiler.disable()
        profile = Profile.of(profiler, half, time.process_time() - c1)
    finally:
        set_job_app(None)
        dispatcher.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if queue.count:
        raise BenchError(f"the in-process RQ worker left {queue.count} jobs")
    return 1000 * wall / half, 1000 * cpu / half, profile


def measure(stack: Stack, args: argparse.Namespace, workers: int, kind: str) -> RunResult:
    """One run, measured again (fresh events) while other processes took too much of the machine."""
    best: RunResult | None = None
    for attempt in range(1, args.retries + 2):
        common.wait_for_quiet(args.wait_idle_run)
        if kind == "latency":
            result = stack.run(workers, kind, round(args.rate * args.seconds), 1, args.rate)
        else:
            result = stack.run(workers, kind, args.events, args.batch if kind == "backlog" else 1, None)
        print(
            f"  {workers} worker(s) {kind:<8} {len(result.sent)} events: committed {result.produce_rate:5.0f}/s, "
            f"delivered {result.rate:5.0f}/s, latency p50 {result.latency_ms(50):6.1f} ms p99 "
            f"{result.latency_ms(99):6.1f} ms, duplicates {result.duplicates}, missing {result.missing}, "
            f"wake-up jobs {result.wake_jobs}, other load {100 * result.other_share:.0f}%",
            flush=True,
        )
        broken = bool(result.db_problems or result.missing or result.duplicates)  # never hidden by a retry
        if best is None or result.other_share < best.other_share or broken:
            best = result
        best.attempts = attempt
        if result.other_share <= args.max_other or broken:
            break
        if attempt <= args.retries:
            print(f"    other processes took {100 * result.other_share:.0f}% of the machine: measuring again")
    assert best is not None
    return best
