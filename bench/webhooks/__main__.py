"""python -m bench.webhooks: see bench/webhooks/__init__.py."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import time
import warnings

import bench.webhooks
from bench import _common as common
from bench import api as bench_api
from bench.webhooks.measure import KINDS, SECTION, Breakdown, RunResult, run_receiver
from bench.webhooks.report import (
    aims,
    breakdown_lines,
    code_digest,
    details_table,
    results_table,
    section,
    settings_lines,
)
from bench.webhooks.scenarios import breakdown, measure
from bench.webhooks.stack import Stack

warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")


# --- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common.argument_parser(bench.webhooks.__doc__, SECTION)
    parser.prog = "python -m bench.webhooks"
    parser.add_argument("--workers", default="1,2", help="worker process counts, comma-separated")
    parser.add_argument("--concurrency", type=int, default=8, help="WEBHOOK_CONCURRENCY of each worker")
    parser.add_argument("--events", type=int, default=2000, help="events of the backlog and stream runs")
    parser.add_argument("--batch", type=int, default=100, help="events per transaction in the backlog run")
    parser.add_argument("--rate", type=float, default=50.0, help="events/s of the latency run")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of the latency run")
    parser.add_argument("--runs", default=",".join(KINDS), help="which runs, comma-separated")
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured events after the workers start")
    parser.add_argument("--breakdown", type=int, default=300, help="deliveries timed in-process (0: skip)")
    parser.add_argument("--profiled", type=int, default=300, help="deliveries run under cProfile in-process")
    parser.add_argument("--rq-jobs", type=int, default=400, help="wake-up jobs run in-process (0: skip)")
    parser.add_argument("--retries", type=int, default=1, help="re-measure a run disturbed by other processes")
    parser.add_argument("--max-other", type=float, default=0.10, help="... above this share of the machine's CPU")
    parser.add_argument("--pg-url", default=None, help="use this PostgreSQL server (a private database is made)")
    parser.add_argument("--wait-idle", type=float, default=30, help="seconds to wait for an idle machine first")
    parser.add_argument("--wait-idle-run", type=float, default=5, help="... and before each run")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' and the receiver's logs")
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    args.workers = [int(w) for w in args.workers.split(",") if w.strip()]
    if not args.workers or min(args.workers) < 1:
        parser.error("--workers needs worker counts >= 1")
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if set(args.runs) - set(KINDS):
        parser.error(f"unknown run(s) {sorted(set(args.runs) - set(KINDS))}; known: {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.receiver:
        return run_receiver()
    common.stop_on_signals()
    started = dt.datetime.now(dt.UTC)
    clock_started = time.monotonic()
    args.code_digest = code_digest()
    session = common.Session("webhooks", keep_logs=args.keep_logs)
    procs, workdir, problems = session.procs, session.workdir, session.problems
    os.environ["PAYINTENT_VAR_DIR"] = str(workdir / "var")
    stack = Stack(workdir, procs, args.concurrency)
    session.on_stop.append(stack.stop_redis)
    results: list[RunResult] = []
    b: Breakdown | None = None
    with session, contextlib.ExitStack() as stack_exit:
        stack_exit.callback(stack.stop_redis)
        stack_exit.callback(procs.stop_all)
        quiet = common.wait_for_quiet(args.wait_idle)
        print("starting: Redis, receiver, PostgreSQL", flush=True)
        stack.start_redis()
        stack.start_receiver()
        stack.prepare_database(stack_exit.enter_context(bench_api.postgresql(args.pg_url, workdir)))
        stack_exit.callback(stack.close_app)
        stack_exit.callback(stack.stop_workers)  # workers stop before PostgreSQL does
        print(f"ready after {time.monotonic() - clock_started:.0f} s", flush=True)
        for workers in args.workers:
            stack.start_workers(workers)
            stack.warm_up(args.warmup)
            for kind in args.runs:
                result = measure(stack, args, workers, kind)
                results.append(result)
                problems += [f"{workers} worker(s), {kind}: {p}" for p in result.db_problems[:5]]
                if result.duplicates:
                    problems.append(f"{workers} worker(s), {kind}: {result.duplicates} duplicate receipts")
                if result.missing:
                    problems.append(f"{workers} worker(s), {kind}: {result.missing} events never received")
        problems += stack.log_problems()
        if code_digest() != args.code_digest:
            problems.append("the webhook code changed during the run: the runs may have measured different code")
        stack.stop_workers()
        if args.breakdown:
            print("breakdown: deliver_one's steps and an RQ wake-up job, in-process", flush=True)
            b = breakdown(stack, args.breakdown, args.profiled, args.rq_jobs)
    if session.exit_code is not None:
        return session.exit_code

    aims_lines = aims(results)
    print()
    print(results_table(results))
    print()
    print(details_table(results))
    if b is not None:
        print()
        print("\n".join(breakdown_lines(b)))
        print("Top functions by own CPU per delivery (cProfile):")
        for line in b.delivery_profile.top:
            print(f"  {line}")
        if b.rq_profile is not None:
            print("Top functions by own CPU per RQ wake-up job (cProfile):")
            for line in b.rq_profile.top:
                print(f"  {line}")

    def write() -> str:
        return section(results, b, aims_lines, settings_lines(stack, args, started, quiet), problems)

    return common.finish(aims_lines, problems, clock_started, SECTION, write if args.write else None)


if __name__ == "__main__":
    sys.exit(main())
