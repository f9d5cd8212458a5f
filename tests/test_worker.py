"""The worker: periodic sweeps are enqueued once per interval and run by a real RQ worker on real Redis."""

from __future__ import annotations

from redis import Redis
from rq import Queue

from backend.queueing import DEFAULT_QUEUE, set_job_app
from backend.webhooks.tasks import WEBHOOK_QUEUE
from backend.worker import PERIODIC, enqueue_due, run_worker
from tests.intents.helpers import URL, create


def test_periodic_jobs_are_enqueued_once_per_interval_across_workers(redis_url):
    connection = Redis.from_url(redis_url)
    names = enqueue_due(connection)
    assert len(names) == len(PERIODIC)
    assert enqueue_due(connection) == []  # a second worker's ticker in the same interval
    by_queue = {name: sum(1 for p in PERIODIC if p.queue == name) for name in (DEFAULT_QUEUE, WEBHOOK_QUEUE)}
    assert sum(by_queue.values()) == len(PERIODIC)
    for name, count in by_queue.items():
        assert Queue(name, connection=connection).count == count


def test_worker_expires_overdue_intents(app, client, merchant, clock, redis_url):
    intent = create(client, merchant)
    clock.advance(minutes=31)
    connection = Redis.from_url(redis_url)
    set_job_app(app)
    try:
        enqueue_due(connection)
        run_worker(connection, burst=True)
    finally:
        set_job_app(None)
    assert Queue(DEFAULT_QUEUE, connection=connection).count == 0
    from backend.extensions import db
    from backend.intents.models import Intent

    db.session.expire_all()
    assert db.session.get(Intent, intent["intent_id"]).status == "expired"
    assert (
        client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers).get_json()["data"]["status"] == "expired"
    )


def test_rq_logs_follow_log_level(redis_url, tmp_path):
    """RQ sets its own loggers' level: the worker hands it LOG_LEVEL (it was always INFO). (The relayer runs no
    RQ worker: its own logger follows LOG_LEVEL like every other.)"""
    import os
    import subprocess

    from tests.test_cli import PAYINTENT

    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env |= {"PAYINTENT_VAR_DIR": str(tmp_path / "var"), "REDIS_URL": redis_url, "LOG_FORMAT": "text"}
    for level, logged in (("WARNING", False), ("INFO", True)):
        done = subprocess.run(
            [PAYINTENT, "worker", "--burst"], env={**env, "LOG_LEVEL": level}, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert ("INFO rq.worker" in done.stderr) is logged, (level, done.stderr)


def test_rq_job_lines_are_debug(redis_url, tmp_path):
    """RQ's three or four lines per job (an idle `make run` printed about 80 per 30 s, scrolling the banner
    away) are DEBUG: hidden at the default INFO, back with LOG_LEVEL=DEBUG. The worker's start stays INFO."""
    import os
    import subprocess

    from tests.test_cli import PAYINTENT

    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env |= {"PAYINTENT_VAR_DIR": str(tmp_path / "var"), "REDIS_URL": redis_url, "LOG_FORMAT": "text"}
    connection = Redis.from_url(redis_url)
    per_job = ("Job OK", "Successfully completed", "result is kept", "deliver_webhooks()")
    for level in ("INFO", "DEBUG"):
        connection.flushdb()
        assert len(enqueue_due(connection)) == len(PERIODIC)
        done = subprocess.run(
            [PAYINTENT, "worker", "--burst"], env={**env, "LOG_LEVEL": level}, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert Queue(DEFAULT_QUEUE, connection=connection).count == 0  # the jobs ran
        assert "INFO rq.worker" in done.stderr and "started with PID" in done.stderr
        job_lines = [line for line in done.stderr.splitlines() if any(text in line for text in per_job)]
        if level == "INFO":
            assert job_lines == [], done.stderr
        else:
            assert len(job_lines) >= 3 * len(PERIODIC) and all(" DEBUG rq." in line for line in job_lines)
