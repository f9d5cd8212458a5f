"""``python -m bench.pay --scenarios ...``: the chain-speed scenarios (bench/pay/chainspeed.py), each followed by
the peer (bench/pay/peer.py) in the same chain mode and concurrency, and the table of both side by side."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import secrets
import time
from collections import defaultdict
from typing import Any

from bench import _common as common
from bench import api as bench_api
from bench.pay import chainspeed as cs
from bench.pay import peer
from bench.pay.measure import SECTION, Payment
from bench.pay.report import scenarios_lines, scenarios_table
from bench.pay.stack import Stack


def new_payments(networks: list[str], count: int) -> list[Payment]:
    from eth_account import Account

    return [Payment(networks[i % len(networks)], Account.from_key(secrets.token_bytes(32))) for i in range(count)]


def fund(stack: Stack, *groups: list[Payment]) -> None:
    buyers: dict[str, list[Any]] = defaultdict(list)
    for p in (q for group in groups for q in group):
        buyers[p.network].append(p.buyer)
    print(f"funding {sum(len(b) for b in buyers.values())} buyers", flush=True)
    stack.fund(buyers)


class Peers:
    """The peer's runs, one per (N, concurrency, block time), each run once per benchmark run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = peer.find_peer_dir()
        self.why = "peer not run (--no-peer)" if args.no_peer else peer.missing(self.dir)
        if self.why:
            print(f"{self.why}; reporting ours only", flush=True)
        self.done: dict[tuple[int, int, int], peer.PeerResult] = {}

    def run(self, scenario: cs.Scenario, ours: int) -> peer.PeerResult:
        n = self.args.peer_payments or ours
        key = (n, scenario.clients, scenario.block_time)
        if key in self.done:
            return self.done[key]
        if self.why:
            result = peer.PeerResult(n, scenario.clients, scenario.block_time, self.args.peer_timeout, note=self.why)
        else:
            bt = f"BLOCK_TIME={scenario.block_time}" if scenario.block_time else "automine"
            print(f"  peer: N={n} CONC={scenario.clients} {bt} NONCE_MANAGER=1, in {self.dir}", flush=True)
            result = peer.run_peer(self.dir, n, scenario.clients, scenario.block_time, self.args.peer_timeout)
            print(
                f"    peer: {result.note}"
                if result.note
                else f"    peer: {result.rate:.1f} settlements/s; p50 {result.p50_ms:.0f} ms; {result.ok} ok, "
                f"{result.fail} failed ({result.seconds:.0f} s)",
                flush=True,
            )
        self.done[key] = result
        return result


def run_scenarios(args: argparse.Namespace) -> int:
    from harness.dev import start_dev

    common.stop_on_signals()
    started = dt.datetime.now(dt.UTC)
    clock_started = time.monotonic()
    session = common.Session("pay")
    procs, workdir, problems = session.procs, session.workdir, session.problems
    chosen = [cs.BY_KEY[k] for k in args.scenarios]
    size = {s.key: args.sizes.get(s.key, s.payments) for s in chosen}
    outcomes: list[cs.Outcome] = []
    peers = Peers(args)
    quiet = 0.0
    with session, contextlib.ExitStack() as exit_all:
        exit_all.callback(procs.stop_all)
        quiet = common.wait_for_quiet(args.wait_idle)
        ours = [s for s in chosen if not s.dev]
        if ours:
            with contextlib.ExitStack() as exit_stack:
                stack = Stack(workdir, procs, args.workers, args.wait_idle_run)
                stack.pay_timeout = args.pay_cap
                print("starting: devnet, Redis, PostgreSQL, API, 4 relayers (RPC straight to Anvil)", flush=True)
                stack.start_devnet(exit_stack)
                stack.start_redis()
                stack.write_chains_files()
                stack.prepare_database(
                    exit_stack.enter_context(bench_api.postgresql(args.pg_url, workdir, stack.connection_budget()))
                )
                exit_stack.callback(stack.stop_relayers)  # relayers stop before PostgreSQL does
                stack.start_api(exit_stack)
                stack.use_relayers(4, 4)
                plan = {s.key: (new_payments(stack.networks, size[s.key]),
                                new_payments(stack.networks, args.warmup)) for s in ours}  # fmt: skip
                fund(stack, *(group for pair in plan.values() for group in pair))
                cpu = stack.cpu_groups()
                for s in ours:
                    common.wait_for_quiet(args.wait_idle_run)
                    outcome = cs.run_scenario(stack, s, *plan[s.key], cpu, args.drain_cap)
                    outcome.peer = peers.run(s, len(outcome.sent))
                    outcomes.append(outcome)
                    problems += outcome.problems
                problems += stack.log_problems()
        for s in (s for s in chosen if s.dev):
            print(f"starting: payintent dev (make run's stack) for {s.key}", flush=True)
            (workdir / "dev").mkdir(exist_ok=True)
            dev = start_dev(workdir / "dev")
            exit_all.callback(dev.stop)
            dstack = cs.dev_bench_stack(dev, workdir, procs)
            dstack.pay_timeout = args.pay_cap
            payments = new_payments(dstack.networks, size[s.key])
            warmup = new_payments(dstack.networks, min(args.warmup, 4))
            fund(dstack, payments, warmup)
            common.wait_for_quiet(args.wait_idle_run)
            outcome = cs.run_scenario(dstack, s, payments, warmup, cs.dev_cpu(dev), args.drain_cap)
            dev.stop()
            outcome.peer = peers.run(s, len(outcome.sent))
            outcomes.append(outcome)
            problems += outcome.problems
    if session.exit_code is not None:
        return session.exit_code
    print()
    print(scenarios_table(outcomes))
    print()
    for line in scenarios_lines(outcomes):
        print(line)
    peer_runs = list(peers.done.values())
    print()
    print(peer.describe(peer_runs))
    print(
        f"- {started:%Y-%m-%d %H:%M} UTC, git {common.git_commit()}, {common.machine()}, Python "
        f"{platform.python_version()}; machine {100 * quiet:.0f}% busy just before; "
        f"reproduce: `.venv/bin/python -m bench.pay {' '.join(args.argv)}`"
        + (f" with {peer.PEER_ENV}={os.environ[peer.PEER_ENV]}" if os.environ.get(peer.PEER_ENV) else "")
    )
    aims = [f"- {o.scenario.key}: {'met' if o.verdict()[0] else 'NOT met'}" for o in outcomes]
    return common.finish(aims, problems, clock_started, SECTION, None)
