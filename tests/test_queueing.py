"""backend.queueing.work: a worker outlives a Redis restart that happens while it runs a job."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from redis import Redis
from rq import Queue
from rq.job import JobStatus

from backend.devstack import start_private_redis

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
