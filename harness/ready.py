"""Readiness: wait until a process answers (HTTP health, an RQ worker registered, a relayer present, Redis ping).

Every wait takes ``check``, called at each poll: it raises to give up (``payintent dev``'s stop signal, a
benchmark's "a process died")."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import requests

from harness.errors import HarnessError

Check = Callable[[], None] | None

# How long a process of ours that is still alive may take to answer: importing the app costs about 1.7 s of CPU per
# process, and ``payintent dev`` starts five at once (gunicorn's two workers, the worker, the relayer); on a loaded
# machine (a 2-core laptop building something, CI's four test workers) that took over 60 s. A process that exits
# fails the wait at once, so the length only matters for a hang.
START_TIMEOUT_SECONDS = 180.0


def wait_until(
    what: str,
    ready: Callable[[], Any],
    timeout: float = 60,
    proc: subprocess.Popen[Any] | None = None,
    *,
    poll: float = 0.1,
    check: Check = None,
) -> None:
    """Until ``ready()`` is truthy (an exception counts as not yet); HarnessError when ``proc`` exits first or
    after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if ready():
                return
        if check is not None:
            check()
        if proc is not None and proc.poll() is not None:
            raise HarnessError(f"{what} exited with {proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise HarnessError(f"{what} was not ready within {timeout:.0f} s")
        time.sleep(poll)


def http_ok(url: str, timeout: float = 1) -> bool:
    """Whether GET ``url`` answers 200."""
    try:
        return requests.get(url, timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def wait_healthy(base_url: str, procs: Sequence[subprocess.Popen[Any]], timeout: float = START_TIMEOUT_SECONDS, *,
                 check: Check = None) -> None:  # fmt: skip
    """Until ``base_url``/healthz answers 200; RuntimeError when one of ``procs`` exits or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check is not None:
            check()
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process of the stack exited during start-up; see its output above")
        if http_ok(f"{base_url}/healthz"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the API did not answer on {base_url} within {timeout:.0f}s")


def redis_ping(url: str) -> bool:
    """Whether the Redis at ``url`` answers PING (within 2 s)."""
    from redis import Redis

    connection = Redis.from_url(url, socket_timeout=2)
    try:
        return bool(connection.ping())
    finally:
        connection.close()


def present_relayers(redis: Any, queue: str | None = None) -> set[int]:
    """The pids of this host's relayers that announce themselves in ``redis`` (a connection; their
    backend.settlement.intake.ALIVE_KEY), those taking settlements of ``queue`` (``RELAYER_QUEUE:<network>``) only
    if given."""
    import json
    import socket

    from backend.settlement.intake import ALIVE_KEY

    pids = set()
    for key in redis.scan_iter(match=ALIVE_KEY.format(host=socket.gethostname(), pid="*"), count=1000):
        value = redis.get(key)
        with contextlib.suppress(ValueError, TypeError):
            if value is not None and (queue is None or queue in json.loads(value)["queues"]):
                pids.add(int((key.decode() if isinstance(key, bytes) else key).rsplit(":", 1)[1]))
    return pids


def wait_registered(
    proc: subprocess.Popen[Any], redis_url: str, timeout: float = START_TIMEOUT_SECONDS, *, check: Check = None
) -> None:
    """Until the RQ worker in ``proc`` (a worker) has registered in Redis, or the relayer in ``proc`` announces
    itself there (present_relayers): it then takes work.
    A Redis that does not answer yet (starting, restarting) counts as "not registered yet". RuntimeError
    when ``proc`` exits first or after ``timeout`` s."""
    from redis import Redis, RedisError
    from rq import Worker

    connection = Redis.from_url(redis_url, socket_timeout=2)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Registration first: a worker may register, take a job and exit (tests' crash faults) between polls.
            with contextlib.suppress(RedisError):
                if proc.pid in present_relayers(connection) or any(
                    w.pid == proc.pid for w in Worker.all(connection=connection)
                ):
                    return
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited during start-up; see its output above")
            if check is not None:
                check()
            time.sleep(0.1)
    finally:
        connection.close()
    raise RuntimeError(f"{proc.args!r} did not register with Redis within {timeout:.0f}s")


def wait_all_registered(
    redis: Any,
    queue: str,
    started: Sequence[subprocess.Popen[Any]],
    what: str,
    check: Callable[[], None],
    *,
    timeout: float,
    poll: float,
) -> None:
    """Until every process of `started` has registered with ``redis`` (a connection) as an RQ worker of
    `queue`, or announced itself as a relayer taking its settlements (present_relayers), polling every `poll` s;
    `check()` raises when one of them died. HarnessError after `timeout` s."""
    from rq import Queue, Worker

    rq_queue = Queue(queue, connection=redis)
    deadline = time.monotonic() + timeout
    while True:
        check()
        registered = {w.pid for w in Worker.all(connection=redis, queue=rq_queue)} | present_relayers(redis, queue)
        if {p.pid for p in started} <= registered:
            return
        if time.monotonic() > deadline:
            raise HarnessError(f"the {what} did not register with Redis within {timeout:.0f} s")
        time.sleep(poll)
