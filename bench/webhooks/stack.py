"""The stack bench/webhooks needs: PostgreSQL, Redis, the receiver and `payintent worker` processes."""

from __future__ import annotations

import bisect
import contextlib
import datetime as dt
import subprocess
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import api as bench_api
from bench._common import HOST, BenchError
from bench.webhooks.measure import EVENT_TYPE, JOB_START, ReceiverClient, RunResult, Sent, clock_offset
from harness import servers
from harness.ready import wait_all_registered

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

        from harness import ready, redis_server

        self.redis_proc, self.redis_url = redis_server.start_redis(self.workdir)
        ready.wait_until("redis-server", lambda: ready.redis_ping(self.redis_url), 10, self.redis_proc)
        self.redis = Redis.from_url(self.redis_url)
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
        started = servers.start_helper(
            self.procs, "bench.webhooks", ["--receiver"], self.workdir / "receiver.log", "receiver"
        )
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
        wait_all_registered(
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
