"""What bench/webhooks measures and how: the receiver (a subprocess), clocks, and the data of a run."""

from __future__ import annotations

import asyncio
import cProfile
import http.client
import json
import os
import pstats
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import _common as common
from bench._common import HOST, ROOT, pct

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


# --- the receiver (runs as a subprocess: `python -m bench.webhooks --receiver`) ---------------------------------

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
