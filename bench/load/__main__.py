"""python -m bench.load: see bench/load/__init__.py."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import time
import warnings
from collections.abc import Callable

import bench.load
from bench import _common as common
from bench.load.checks import check
from bench.load.measure import SECTION, Mix, table
from bench.load.report import Outcome, report, section, settings_lines
from bench.load.scenarios import measure, start
from bench.load.stack import LoadStack
from harness import audit

warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common.argument_parser(bench.load.__doc__, SECTION)
    parser.prog = "python -m bench.load"
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
        wallets = [b.address for b in stack.buyers] + [m.payout for m in stack.merchants]
        balances_before = audit.balances(stack.tokens(), {n: wallets for n in stack.networks})
        print(f"ready after {time.monotonic() - clock_started:.0f} s", flush=True)
        workload, used, bounds = measure(stack, args)
        found, rows, received = check(stack, workload, balances_before)
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
