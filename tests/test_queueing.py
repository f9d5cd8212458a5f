"""backend.queueing.work: a worker outlives a Redis restart that happens while it runs a job, and stops within
seconds of a stop signal whatever it waits on."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from rq import Queue
from rq.job import JobStatus

from backend.queueing import STOP_DEADLINE_SECONDS, STOP_GRACE_SECONDS
from harness.redis_server import start_redis as start_private_redis

WORKER = """
import sys
from redis import Redis
from backend.queueing import work
work(["drill"], Redis.from_url(sys.argv[1]))
"""


def _until(check, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_worker_survives_redis_restarting_mid_job_and_stops_on_sigterm(tmp_path: Path) -> None:
    redis_proc, url = start_private_redis(tmp_path)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, url], stderr=subprocess.PIPE, text=True)
    try:
        connection = Redis.from_url(url)
        job = Queue("drill", connection=connection).enqueue("time.sleep", 1.5)
        _until(lambda: job.get_status(refresh=True) == JobStatus.STARTED)
        redis_proc.kill()  # Redis dies while the job runs: RQ raises when it records the job's end
        redis_proc.wait()
        time.sleep(2.0)
        assert worker.poll() is None, "the worker exited when Redis went away"
        redis_proc, url = start_private_redis(tmp_path)  # back, empty, on the same socket

        connection = Redis.from_url(url)
        after = Queue("drill", connection=connection).enqueue("os.getpid")
        _until(lambda: after.get_status(refresh=True) == JobStatus.FINISHED)
        assert after.return_value() == worker.pid  # the same process took the next job

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=20) == 0
        assert worker.stderr is not None
        assert "lost Redis while working" in worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()
        redis_proc.kill()


# --- stopping: a stop signal stops the worker and the relayer within seconds, whatever they wait on ---------

PAYINTENT = str(Path(sys.executable).with_name("payintent"))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for a Redis unix socket (the path of one is limited to about 100 characters)."""
    path = Path(tempfile.mkdtemp(prefix="rq-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stderr_shows(path: Path, text: str) -> bool:
    return text in path.read_text(errors="replace")


@pytest.mark.parametrize(
    ("command", "sig"),
    [("worker", signal.SIGTERM), ("relayer", signal.SIGTERM), ("worker", signal.SIGINT), ("relayer", signal.SIGHUP)],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else value,
)
def test_a_stop_signal_stops_worker_and_relayer_while_redis_is_gone(
    command: str, sig: signal.Signals, tmp_path: Path, short_dir: Path
) -> None:
    """They used to ignore SIGTERM for minutes, retrying a Redis that had gone (the stop landed in RQ's
    loop, whose teardown then failed on Redis, and the retry loop waited for Redis with the signal spent)."""
    from eth_account import Account

    from harness.ready import wait_registered
    from tests.conftest import free_port

    redis_proc, url = start_private_redis(short_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CHAINS_FILE", "RELAY_KEYS_FILE")}
    env |= {"PAYINTENT_VAR_DIR": str(tmp_path / "var"), "REDIS_URL": url, "LOG_FORMAT": "text", "LOG_LEVEL": "INFO"}
    # The relayer needs keys to start: one fresh key for Base Sepolia, whose RPC does not answer (not needed here).
    env |= {"RELAY_KEYS": json.dumps({"eip155:84532": [Account.create().key.hex()]}),
            "BASE_SEPOLIA_RPC_URL": f"http://127.0.0.1:{free_port()}"}  # fmt: skip
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen([PAYINTENT, command], env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_registered(proc, url)
        redis_proc.kill()  # Redis goes away
        redis_proc.wait()
        # It noticed, and waits for Redis. The worker says so in RQ's words when Redis went while it waited for a
        # job, in ours ("lost Redis while working") when it went earlier in RQ's loop (a CI failure: killed right
        # after the registration, before the first wait); the relayer in its own.
        _until(lambda: _stderr_shows(stderr, "could not connect to Redis") or _stderr_shows(stderr, "lost Redis"))
        proc.send_signal(sig)
        started = time.monotonic()
        code = proc.wait(timeout=STOP_DEADLINE_SECONDS + 10)
        took = time.monotonic() - started
        assert code == 0, stderr.read_text()[-3000:]  # a clean stop, not the deadline's forced exit
        assert took < 10, took  # seconds, not minutes; the margin is for a loaded machine (4 xdist workers)
    finally:
        if proc.poll() is None:
            proc.kill()
        if redis_proc.poll() is None:
            redis_proc.kill()


JOB_WORKER = """
import sys
from redis import Redis
from backend.queueing import work
work(["drill"], Redis.from_url(sys.argv[1]), logging_level="DEBUG")
"""


def _start_job_worker(url: str, stderr: Path) -> subprocess.Popen[bytes]:
    with stderr.open("w") as err:
        return subprocess.Popen([sys.executable, "-c", JOB_WORKER, url], stderr=err)


def test_a_stop_signal_lets_a_short_job_finish(short_dir: Path) -> None:
    redis_proc, url = start_private_redis(short_dir)
    worker = _start_job_worker(url, short_dir / "stderr")
    try:
        connection = Redis.from_url(url)
        job = Queue("drill", connection=connection).enqueue("time.sleep", 1.5)
        _until(lambda: job.get_status(refresh=True) == JobStatus.STARTED)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=STOP_GRACE_SECONDS + 10) == 0
        assert job.get_status(refresh=True) == JobStatus.FINISHED  # it finished its step, then stopped
    finally:
        if worker.poll() is None:
            worker.kill()
        redis_proc.kill()


@pytest.mark.parametrize("redis_gone", [False, True], ids=["redis-up", "redis-gone"])
def test_a_stop_signal_interrupts_a_long_job_after_the_grace_period(short_dir: Path, redis_gone: bool) -> None:
    """A job still running STOP_GRACE_SECONDS after the signal is interrupted (StopNow, which its own
    ``except Exception`` does not swallow), also when Redis has gone meanwhile."""
    redis_proc, url = start_private_redis(short_dir)
    worker = _start_job_worker(url, short_dir / "stderr")
    try:
        connection = Redis.from_url(url)
        job = Queue("drill", connection=connection).enqueue("tests.test_queueing.stubborn_job", 120, job_timeout=600)
        _until(lambda: job.get_status(refresh=True) == JobStatus.STARTED)
        if redis_gone:
            redis_proc.kill()
            redis_proc.wait()
        worker.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert worker.wait(timeout=STOP_DEADLINE_SECONDS + 10) == 0, (short_dir / "stderr").read_text()[-3000:]
        # the grace, not the deadline (STOP_DEADLINE_SECONDS, 15 s); the margin is for a loaded machine
        assert STOP_GRACE_SECONDS - 0.5 < time.monotonic() - started < STOP_GRACE_SECONDS + 8
        if not redis_gone:
            assert job.get_status(refresh=True) == JobStatus.FAILED
            assert "StopNow" in (job.latest_result().exc_string or "")
    finally:
        if worker.poll() is None:
            worker.kill()
        redis_proc.kill()


def stubborn_job(seconds: float) -> None:
    """Sleeps, and carries on past any ordinary exception (as a retry loop would)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the point: StopNow is not an Exception
            time.sleep(0.1)


def test_threads_asking_for_the_apps_redis_at_once_share_one_client_with_room_for_every_thread(
    redis_url, chains, monkeypatch
):
    """gunicorn's threads share the app: the first requests, all at once, make one Redis client (not one each, the
    others' pools lost), and its pool takes more connections than `serve --threads` runs threads (each waiting
    /pay holds one in BLPOP; redis-py's from_url default of 100 raised "Too many connections" past it)."""
    import threading

    import backend.ephemeral
    import backend.queueing
    from backend.app import create_app
    from backend.ephemeral import memory_store
    from backend.queueing import app_redis
    from tests.conftest import make_settings

    def slowly(make):  # type: ignore[no-untyped-def]
        def made(*args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(0.05)  # a real first connection takes a while: the other threads arrive meanwhile
            return make(*args, **kwargs)

        return made

    monkeypatch.setattr(backend.queueing, "redis_from_url", slowly(backend.queueing.redis_from_url))
    monkeypatch.setattr(backend.ephemeral, "MemoryStore", slowly(backend.ephemeral.MemoryStore))

    app = create_app(make_settings("sqlite://", redis_url=redis_url), chains=chains)
    start = threading.Barrier(32)
    made: list[object] = []

    def first_request() -> None:
        with app.app_context():
            start.wait()
            made.extend([app_redis(), app_redis(fast=True), memory_store()])

    threads = [threading.Thread(target=first_request) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(made) == 3 * 32 and len({id(client) for client in made}) == 3
    with app.app_context():
        redis = app_redis()
        assert redis is not None and redis.connection_pool.max_connections >= 256
