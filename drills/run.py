"""``make drills``: scripted faults against the full local stack, with the money and the events checked
after each.

Every drill pays real intents on the devnet (drills/payments.py: buyers that retry, half the time
with a freshly signed authorization) while one part of the stack fails, then audits the chain and
the database: payments attempted and settled, double charges and unrecorded charges (both must be
0), and events lost (every event must reach both webhook receivers; 0 lost). A drill whose audit
finds a problem, whose payments do not all settle, or whose buyers got a 500 (or an error answer without
the JSON envelope) fails the run (exit 1).

    .venv/bin/python -m drills.run                    # all nine, about 13 minutes
    .venv/bin/python -m drills.run --only relayer api --seed 7
    .venv/bin/python -m drills.run --write            # ... and update docs/drills.md's results
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from drills.payments import Figures, Payment, audit, control, make_payments, snapshot, start_buyers, wait_all
from drills.stack import RECEIVERS, DrillError, Stack
from harness import report
from harness.env import ROOT
from harness.session import Session, stop_on_signals

DOC = ROOT / "docs" / "drills.md"
HEADING = "## Results"
DRAIN_SECONDS = 240.0  # after the last fault: the reconciler re-sends a stale settlement after 30-45 s
READS_LOST = 0.1  # rpcloss: of the single reads' answers (sends and batches: 30-50 %)
BLOCK_SECONDS = 2  # watcher: the chains mine a block this often


@dataclass
class Outcome:
    payments: list[Payment]
    faults: str
    in_flight: int = 0  # payments started and not yet settled when a fault struck
    problems: list[str] = field(default_factory=list)


Drill = Callable[[Stack, random.Random], Outcome]


def _in_flight(payments: list[Payment]) -> int:
    return sum(1 for p in payments if not p.done.is_set())


def _outages(stack: Stack, rng: random.Random, tag: str, waves: int, down: Callable[[], None],
             up: Callable[[], None], seconds: float,
             last_seconds: float | None = None) -> tuple[list[Payment], int]:  # fmt: skip
    """Per wave: 5 buyers start, the part goes `down()` 0.05-0.4 s later (their payments in flight),
    5 more buyers start during the outage, and after `seconds` (the last wave: `last_seconds`, if given)
    it comes back `up()`. Then every buyer is waited for. Returns the payments and how many were in
    flight at the faults."""
    per_wave = 5
    payments = make_payments(stack, tag, waves * 2 * per_wave, rng)
    last = seconds if last_seconds is None else last_seconds
    deadline = time.monotonic() + waves * (seconds + 15) + (last - seconds) + DRAIN_SECONDS
    in_flight = 0
    for wave in range(waves):
        before, during = (payments[(2 * wave + i) * per_wave : (2 * wave + i + 1) * per_wave] for i in (0, 1))
        start_buyers(stack, before, deadline, rng)
        time.sleep(rng.uniform(0.05, 0.4))
        in_flight += _in_flight(before)
        down()
        start_buyers(stack, during, deadline, rng)
        time.sleep(last if wave == waves - 1 else seconds)
        up()
        time.sleep(1.0)
    wait_all(payments, deadline)
    return payments, in_flight


def relayer_drill(stack: Stack, rng: random.Random) -> Outcome:
    """The relayer killed at random points of 50 settlements: SIGKILL at a random moment, or a crash
    (PAYINTENT_FAULT) right after the transaction is recorded, after the broadcast, before the finish."""
    from relayer.faults import POINTS

    modes = ("sigkill", *POINTS)
    crashes_before = Counter(stack.crashes)
    payments = make_payments(stack, "relayer", 50, rng)
    deadline = time.monotonic() + 10 * 15 + DRAIN_SECONDS
    kills = in_flight = 0
    try:
        for wave in range(10):
            group = payments[wave * 5 : (wave + 1) * 5]
            mode = modes[wave % len(modes)]
            if mode != "sigkill":  # this wave meets a relayer that dies when a settlement reaches `mode`
                stack.restart("relayer", fault=mode)
            start_buyers(stack, group, deadline, rng)
            if mode == "sigkill":
                time.sleep(rng.uniform(0.02, 0.4))  # a settlement takes about half a second on the devnet
                in_flight += _in_flight(group)
                stack.restart("relayer")
                kills += 1
            else:
                time.sleep(2.0)  # the supervisor starts it again (without a fault) after its crash
            time.sleep(1.0)
        wait_all(payments, deadline)
    finally:
        if stack.relayer_fault:
            stack.restart("relayer")
    crashes = stack.crashes - crashes_before
    faults = [f"{kills} x SIGKILL", *(f"{n} x crash {point}" for point, n in sorted(crashes.items()))]
    return Outcome(payments, ", ".join(faults), in_flight)


def _mining(stack: Stack, on: bool) -> None:
    """Every chain mines each transaction at once (Anvil's automine), or nothing until this is called again."""
    from devnet.anvil import rpc

    for network in stack.networks:
        rpc(stack.anvil_url[network], "evm_setAutomine", [on])
        if on:
            rpc(stack.anvil_url[network], "evm_mine")  # what waits in the pool, at once


def inflight_drill(stack: Stack, rng: random.Random) -> Outcome:
    """The relayer SIGKILLed with transactions in flight: the chains stop mining, 9 settlements are sent (one
    relayer process, its settlement threads), the relayer dies with them unmined, three times; the chains mine
    again before or after a new relayer starts."""
    from devnet.anvil import rpc

    def in_pool() -> int:
        return sum(int(rpc(stack.anvil_url[n], "txpool_status")["pending"], 16) for n in stack.networks)

    def mining(on: bool) -> None:
        _mining(stack, on)

    waves, per_wave = 3, 9
    payments = make_payments(stack, "inflight", waves * per_wave, rng)
    deadline = time.monotonic() + waves * 30 + DRAIN_SECONDS
    in_flight = 0
    # Each /pay holds a sync gunicorn worker while it waits for its (unmined) settlement: enough of them that a
    # wave's payments all reach the relayer.
    stack.restart("api", workers=per_wave + 1)
    try:
        for wave in range(waves):
            mining(False)
            start_buyers(stack, payments[wave * per_wave : (wave + 1) * per_wave], deadline, rng)
            until = time.monotonic() + rng.uniform(3.0, 8.0)  # sent, waiting for blocks that do not come
            while time.monotonic() < until and in_pool() < per_wave:
                time.sleep(0.2)
            in_flight += in_pool()
            stack.take_down("relayer")  # SIGKILL
            if wave % 2 == 0:
                mining(True)  # mined while no relayer runs: the reconciler finishes them
                stack.bring_up("relayer")
            else:
                stack.bring_up("relayer")  # a new relayer finds them pending: nothing is sent twice
                time.sleep(rng.uniform(0.5, 3.0))
                mining(True)
        wait_all(payments, deadline)
    finally:
        mining(True)
        if "relayer" in stack.held_down:
            stack.bring_up("relayer")
        stack.restart("api")
    return Outcome(payments, f"{waves} x SIGKILL with transactions in flight (chains not mining)", in_flight)


def _blocks_every(stack: Stack, seconds: int) -> None:
    """Every chain mines a block every `seconds`, whatever waits in its pool (`_mining(stack, True)` ends it)."""
    from devnet.anvil import rpc

    for network in stack.networks:
        rpc(stack.anvil_url[network], "evm_setIntervalMining", [seconds])


def watcher_drill(stack: Stack, rng: random.Random) -> Outcome:
    """The relayer killed between a block and its commit (2 s blocks), four times, with settlements mined unrecorded.
    4 waves of 9 settlements, several per block: the relayer crashes right after its block watcher handed a block's
    receipts to two or more settlement threads (PAYINTENT_FAULT=after-watch-block), or is SIGKILLed 0-0.4 s after
    a block holding two or more."""
    from relayer.faults import WATCH_POINT

    waves, per_wave = 4, 9
    payments = make_payments(stack, "watcher", waves * per_wave, rng)
    deadline = time.monotonic() + waves * 40 + DRAIN_SECONDS
    caught: dict[str, list[int]] = {"crash": [], "sigkill": []}  # per kill: settlements mined and not recorded
    missed = in_flight = 0
    stack.restart("api", workers=per_wave + 1)  # each /pay holds a worker until its block comes (as in `inflight`)
    try:
        _blocks_every(stack, BLOCK_SECONDS)
        stack.restart("relayer", fault=WATCH_POINT)
        for wave in range(waves):
            group = payments[wave * per_wave : (wave + 1) * per_wave]
            crash = wave % 2 == 0
            crashes, heads = stack.crashes[WATCH_POINT], stack.heads()
            start_buyers(stack, group, deadline, rng)
            until = time.monotonic() + 30
            if crash:  # the supervisor starts it again, without the fault
                while stack.crashes[WATCH_POINT] == crashes and time.monotonic() < until:
                    time.sleep(0.02)
                if stack.crashes[WATCH_POINT] == crashes:  # no round woke two settlements at once
                    missed += 1
                    stack.restart("relayer")
                    continue
            else:
                while not stack.block_with(2, heads) and time.monotonic() < until:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 0.4))  # the watcher reads a head within a quarter block time
                stack.take_down("relayer")  # SIGKILL
            in_flight += _in_flight(group)
            unrecorded = stack.mined_unrecorded([p.intent_id for p in group if p.intent_id])
            caught["crash" if crash else "sigkill"].append(unrecorded)
            if not crash:  # started again; armed with the crash point for the next wave
                stack.bring_up("relayer", fault=WATCH_POINT if wave + 1 < waves else None)
        wait_all(payments, deadline)
    finally:
        _mining(stack, True)
        if "relayer" in stack.held_down:
            stack.bring_up("relayer")
        elif stack.relayer_fault:
            stack.restart("relayer")
        stack.restart("api")
    problems = [] if sum(caught["crash"]) else ["no crash at after-watch-block left a mined settlement unrecorded"]

    def kills(counts: list[int]) -> str:
        return ", ".join(map(str, counts)) or "-"

    faults = (
        f"{BLOCK_SECONDS} s blocks; {len(caught['crash'])} x crash {WATCH_POINT}"
        + (f" ({missed} wave(s) never reached it)" if missed else "")
        + f", {len(caught['sigkill'])} x SIGKILL 0-0.4 s after a block of 2+; mined and unrecorded at each kill: "
        f"{kills(caught['crash'])} / {kills(caught['sigkill'])}"
    )
    return Outcome(payments, faults, in_flight, problems)


def api_drill(stack: Stack, rng: random.Random) -> Outcome:
    """The API (gunicorn and its workers) SIGKILLed while /pay calls are in flight, 1 s down, three times."""
    payments, in_flight = _outages(
        stack, rng, "api", 3, lambda: stack.take_down("api"), lambda: stack.bring_up("api"), seconds=1.0
    )
    return Outcome(payments, "3 x API SIGKILL mid-/pay, 1 s down", in_flight)


def redis_drill(stack: Stack, rng: random.Random) -> Outcome:
    """Redis flushed (every queue, lock and nonce hint gone), killed, and started again empty, twice."""
    payments, in_flight = _outages(stack, rng, "redis", 2, stack.flush_and_kill_redis, stack.start_redis, seconds=3.0)
    return Outcome(payments, "2 x Redis FLUSHALL + kill, 3 s down", in_flight)


def postgres_drill(stack: Stack, rng: random.Random) -> Outcome:
    """PostgreSQL stopped hard (pg_ctl -m immediate: a crash) for 3 s, twice."""
    payments, in_flight = _outages(
        stack, rng, "postgres", 2, stack.stop_postgres, stack.start_postgres_again, seconds=3.0
    )
    return Outcome(payments, "2 x PostgreSQL crash, 3 s down", in_flight)


def rpc_drill(stack: Stack, rng: random.Random) -> Outcome:
    """Every chain's RPC endpoint refusing connections for 8 s, twice."""

    def down() -> None:
        for network in stack.networks:
            stack.kill(f"rpc-{network}")

    def up() -> None:
        for network in stack.networks:
            stack.start_proxy(network)

    payments, in_flight = _outages(stack, rng, "rpc", 2, down, up, seconds=8.0)
    return Outcome(payments, "2 x every chain RPC down 8 s", in_flight)


def rpcloss_drill(stack: Stack, rng: random.Random) -> Outcome:
    """Every chain's RPC losing answers for 10 s, 10 s and 45 s: 30-50 % of the sent transactions' and the JSON-RPC
    batches' (the request reaches the chain, its answer never comes back or stops halfway), 10 % of other reads'
    (more, and few settlements would get as far as a send). In the last window the chains do not mine: the
    reconciler (after 30 s) sends the settlements left open again, and the relayer reads their receipts in a
    batch (a settlement already submitted) and gets its answer lost too."""
    fractions: list[int] = []
    waves = 3

    def down() -> None:
        fractions.append(rng.randint(30, 50))
        stack.lose_rpc_answers(fractions[-1] / 100, rng.randrange(2**31), reads=READS_LOST)
        if len(fractions) == waves:
            _mining(stack, False)

    def up() -> None:
        stack.lose_rpc_answers(0)
        if len(fractions) == waves:
            _mining(stack, True)

    log_before = len(stack.rpc_loss_log())
    try:
        payments, in_flight = _outages(stack, rng, "rpcloss", waves, down, up, 10.0, 45.0)
    finally:
        stack.lose_rpc_answers(0)
        _mining(stack, True)
    log = stack.rpc_loss_log()[log_before:]  # the last window's "seen" line: written at its first request after
    lost = [line.split(" ", 2)[2] for line in log if line.startswith("lost ")]
    seen: Counter[str] = Counter()
    for line in log:
        if line.startswith("seen "):
            for part in line.removeprefix("seen ").split(", "):
                number, kind = part.split(" ")
                seen[kind] += int(number)
    sends = sum(1 for line in lost if " eth_sendRawTransaction" in line)
    batches = sum(1 for line in lost if " batch[" in line)
    cut = sum(line.startswith("cut") for line in lost)
    faults = (
        f"every chain RPC losing answers 10/10/45 s (the last not mining): {'/'.join(map(str, fractions))} % of "
        f"sends and batches, {READS_LOST:.0%} of reads; lost {sends}/{seen['sends']} sends, "
        f"{batches}/{seen['batches']} batches, {len(lost) - sends - batches}/{seen['reads']} reads ({cut} cut halfway)"
    )
    return Outcome(payments, faults, in_flight)


def webhooks_drill(stack: Stack, rng: random.Random) -> Outcome:
    """Both receivers down for a whole retry cycle (the worker's clock moved through the schedule):
    receiver A comes back before the last attempt and gets everything from the schedule; receiver B
    stays down through all five attempts, then its failed deliveries are replayed through the API."""
    from backend.webhooks.services import MAX_ATTEMPTS, RETRY_DELAYS_SECONDS

    for name in RECEIVERS:
        stack.kill(name)
    payments = make_payments(stack, "webhooks", 10, rng)
    wait_all(payments, _start(stack, payments, rng))
    ids = [p.intent_id for p in payments if p.intent_id]
    _wait_attempts(stack, ids, 1)
    offset = 0.0
    for number, delay in enumerate(RETRY_DELAYS_SECONDS, start=2):
        if number == MAX_ATTEMPTS:
            stack.start_receiver(RECEIVERS[0])
        offset += delay + 1
        stack.set_clock_offset(offset)
        _wait_attempts(stack, ids, number)
    stack.set_clock_offset(0)
    stack.start_receiver(RECEIVERS[1])
    replayed = _replay_failed(stack)
    a, b = (stack.endpoint_id[name] for name in RECEIVERS)
    problems = [] if set(replayed) <= {b} else [f"{replayed[a]} deliveries to A failed though A was back in time"]
    return Outcome(
        payments,
        f"receivers down {offset / 3600:.1f} h of worker clock ({MAX_ATTEMPTS} attempts); A back before the last "
        f"attempt, B's {replayed[b]} failed deliveries replayed",
        problems=problems,
    )


def _start(stack: Stack, payments: list[Payment], rng: random.Random) -> float:
    deadline = time.monotonic() + DRAIN_SECONDS
    start_buyers(stack, payments, deadline, rng)
    return deadline


def _wait_attempts(stack: Stack, intent_ids: list[str], number: int, timeout: float = 60) -> None:
    """Until every delivery of these intents' events has made `number` attempts (or has succeeded)."""
    import sqlalchemy as sa

    engine = sa.create_engine(stack.database_url, poolclass=sa.pool.NullPool)
    query = sa.text(
        "SELECT count(*) FROM webhook_deliveries d JOIN events e ON e.id = d.event_id "
        "WHERE e.intent_id IN :ids AND d.replay_of IS NULL AND d.attempt_count < :n AND d.status != 'succeeded'"
    ).bindparams(sa.bindparam("ids", expanding=True))
    deadline = time.monotonic() + timeout
    try:
        while True:
            with engine.connect() as conn:
                behind = conn.execute(query, {"ids": intent_ids, "n": number}).scalar()
            if behind == 0:
                return
            if time.monotonic() > deadline:
                raise DrillError(f"{behind} webhook deliveries did not make attempt {number} within {timeout:.0f} s")
            time.sleep(0.3)
    finally:
        engine.dispose()


def _replay_failed(stack: Stack) -> Counter[str]:
    """Replay every failed delivery through the API, as a merchant would; how many, by endpoint."""
    status, body = stack.api("GET", "/api/v1/webhooks/deliveries?status=failed&limit=100")
    if status != 200:
        raise DrillError(f"listing failed deliveries answered {status}: {body}")
    replayed: Counter[str] = Counter()
    for delivery in body["data"]["deliveries"]:
        status, answer = stack.api("POST", f"/api/v1/webhooks/deliveries/{delivery['delivery_id']}/replay")
        if status != 202:
            raise DrillError(f"replaying {delivery['delivery_id']} answered {status}: {answer}")
        replayed[delivery["webhook_id"]] += 1
    return replayed


DRILLS: dict[str, Drill] = {
    "relayer": relayer_drill,
    "inflight": inflight_drill,
    "watcher": watcher_drill,
    "api": api_drill,
    "redis": redis_drill,
    "postgres": postgres_drill,
    "rpc": rpc_drill,
    "rpcloss": rpcloss_drill,
    "webhooks": webhooks_drill,
}


def run_one(stack: Stack, name: str, drill: Drill, rng: random.Random) -> tuple[Figures, Outcome, float]:
    stack.new_payout_wallets()
    before = snapshot(stack)
    started = time.monotonic()
    exits_before = len(stack.unexpected_exits)
    outcome = drill(stack, rng)
    figures = audit(stack, outcome.payments, before, time.monotonic() + 90)
    if figures.settled != figures.attempted:
        figures.problems.append(f"{figures.attempted - figures.settled} of {figures.attempted} payments never settled")
    figures.problems += outcome.problems
    figures.problems += [f"{exit} (restarted)" for exit in stack.unexpected_exits[exits_before:]]
    if figures.lost:
        figures.problems.append(f"{figures.lost} webhook deliveries of this drill's events never arrived")
    figures.problems += bad_answers(figures.answers)
    return figures, outcome, time.monotonic() - started


def bad_answers(answers: Counter[str]) -> list[str]:
    """A fault may make the API refuse (503 SERVICE_UNAVAILABLE, CHAIN_UNAVAILABLE...), never fail: any 500,
    and any error answer without the JSON envelope's code (a server's own error page), is a problem."""
    problems = []
    for answer, count in sorted(answers.items()):
        status, _, code = answer.partition(" ")
        if not status.isdigit():  # "connection ...": the API was down, which is the drill's doing
            continue
        if status == "500":
            problems.append(f"the API answered {answer} {count} time(s): an unhandled error (its traceback is in "
                            "api.log, kept); a fault must get a JSON error with a fitting status")  # fmt: skip
        elif int(status) >= 400 and not code:
            problems.append(f"the API answered {status} {count} time(s) without the JSON error envelope")
    return problems


Row = tuple[str, Figures, Outcome, float]


def table(rows: list[Row]) -> str:
    lines = [
        "| drill | faults | attempted | in flight at a fault | settled | double-charged | unrecorded | events | lost "
        "| redelivered | s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, f, outcome, seconds in rows:
        lines.append(
            f"| {name} | {outcome.faults} | {f.attempted} | {outcome.in_flight} | {f.settled} | {f.double_charged} | "
            f"{f.unrecorded} | {f.events} | {f.lost} | {f.redelivered} | {seconds:.0f} |"
        )
    return "\n".join(lines)


def answers_lines(rows: list[Row]) -> list[str]:
    lines = []
    for name, f, _outcome, _seconds in rows:
        seen = ", ".join(f"{code}: {n}" for code, n in sorted(f.answers.items()))
        lines.append(f"- {name}: {seen or 'none'}")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(DRILLS), help="run only these drills")
    parser.add_argument("--seed", type=int, help="random seed (printed; default: random)")
    parser.add_argument("--write", action="store_true", help=f"rewrite the results in {DOC.relative_to(ROOT)}")
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs even when all passed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    clock_started = time.monotonic()
    stop_on_signals()
    rows: list[Row] = []
    session = Session("drills", keep_logs=args.keep_logs, label="drills")
    with session:
        print(f"drills: seed {seed}; starting PostgreSQL, Redis, 3 Anvil chains, API, worker, relayer ...", flush=True)
        stack = Stack(session)
        try:
            stack.start()
            print(f"stack up in {time.monotonic() - clock_started:.0f} s; logs in {session.workdir}", flush=True)
            for name in args.only or list(DRILLS):
                print(f"\n== {name}: {(DRILLS[name].__doc__ or '').split(chr(10))[0]}", flush=True)
                figures, outcome, seconds = run_one(stack, name, DRILLS[name], rng)
                rows.append((name, figures, outcome, seconds))
                print(table([rows[-1]]).splitlines()[-1], flush=True)
                for problem in figures.problems:
                    print(f"  PROBLEM: {problem}", flush=True)
                session.problems += [f"{name}: {p}" for p in figures.problems]
            print(
                "\n== control: the audit must find a planted double charge, unrecorded charge and lost event",
                flush=True,
            )
            found = control(stack, rng)
            print("  " + ("; ".join(found) if found else "all three found"), flush=True)
            session.problems += found
        finally:
            stack.stop_supervising()
    if session.exit_code is not None:
        return session.exit_code
    text = _report(rows, seed, argv)
    print("\n" + text.split("\n", 4)[4])
    status = report.finish([], session.problems, clock_started, HEADING, None)
    if args.write and status == 0:
        report.write_section(text, HEADING, DOC)
        print(f"wrote the section '{HEADING}' of {DOC.relative_to(ROOT)}")
    return status


def _report(rows: list[Row], seed: int, argv: list[str] | None) -> str:
    command = " ".join(["python -m drills.run", *(sys.argv[1:] if argv is None else argv)])
    return "\n".join(
        [
            HEADING,
            "",
            "Written by `python -m drills.run --write` (the last run on the development machine; CI runs them on every "
            "push).",
            "",
            table(rows),
            "",
            "Answers the buyers got, by HTTP status and error code (a connection error: the API was down):",
            "",
            *answers_lines(rows),
            "",
            "Control: the audit found the planted double charge, unrecorded charge and missing event.",
            "",
            f"Run: `{command}`, seed {seed}, commit {report.git_commit()}, {report.machine()}.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
