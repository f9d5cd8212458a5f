"""Deliveries through real workers and real Redis: woken after commit, and nothing lost when Redis is flushed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from redis import Redis
from rq import Queue

from backend.extensions import db
from backend.queueing import set_job_app
from backend.webhooks.models import WebhookDelivery
from backend.webhooks.tasks import WAKE_KEY, WEBHOOK_QUEUE
from backend.worker import enqueue_due, run_worker
from tests.webhooks.helpers import register, send_test

PAYINTENT = str(Path(sys.executable).with_name("payintent"))


def _with_redis(app, redis_url):
    settings = app.config["PAYINTENT_SETTINGS"]
    app.config["PAYINTENT_SETTINGS"] = settings.__class__(**{**settings.__dict__, "redis_url": redis_url})
    app.extensions.pop("payintent.redis", None)


def test_commit_wakes_one_coalesced_job(app, client, merchant, receiver, redis_url):
    _with_redis(app, redis_url)
    endpoint = register(client, merchant, receiver.url())
    for _ in range(5):
        send_test(client, merchant, endpoint["webhook_id"])
    connection = Redis.from_url(redis_url)
    assert Queue(WEBHOOK_QUEUE, connection=connection).count == 1  # five commits, one wake-up waiting
    set_job_app(app)
    try:
        run_worker(connection, burst=True)
    finally:
        set_job_app(None)
    assert len(receiver.wait_for(5)) == 5
    assert connection.get(WAKE_KEY) is None


def test_redis_flushed_midway_loses_no_webhook(app, client, merchant, receiver, redis_url):
    _with_redis(app, redis_url)
    endpoint = register(client, merchant, receiver.url())
    queued = [send_test(client, merchant, endpoint["webhook_id"])["event_id"] for _ in range(3)]
    connection = Redis.from_url(redis_url)
    connection.flushdb()  # the wake-up job is gone
    assert Queue(WEBHOOK_QUEUE, connection=connection).count == 0
    set_job_app(app)
    try:
        enqueue_due(connection)  # the ticker's periodic sweep, as any running worker does every 2 s
        run_worker(connection, burst=True)
    finally:
        set_job_app(None)
    got = receiver.wait_for(3)
    assert sorted(r.headers["webhook-id"] for r in got) == sorted(queued)
    db.session.expire_all()
    assert {d.status for d in db.session.query(WebhookDelivery)} == {"succeeded"}


def test_two_worker_processes_deliver_each_event_once(app, client, merchant, receiver, redis_url, db_url):
    _with_redis(app, redis_url)
    endpoint = register(client, merchant, receiver.url())
    env = {**os.environ, "DATABASE_URL": db_url, "REDIS_URL": redis_url, "WEBHOOK_ALLOW_PRIVATE_TARGETS": "1",
           "LOG_LEVEL": "WARNING", "WEBHOOK_CONCURRENCY": "4"}  # fmt: skip
    workers = [
        subprocess.Popen([PAYINTENT, "worker"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(2)
    ]
    try:
        time.sleep(1.0)
        queued = [send_test(client, merchant, endpoint["webhook_id"])["event_id"] for _ in range(40)]
        got = receiver.wait_for(40, timeout=30)
        time.sleep(0.5)  # a duplicate would arrive now
    finally:
        for proc in workers:
            proc.terminate()
        for proc in workers:
            proc.wait(timeout=30)
    ids = [r.headers["webhook-id"] for r in receiver.requests]
    assert sorted(ids) == sorted(queued), "an event was lost or sent twice"
    assert len(got) == 40
    db.session.expire_all()
    assert {(d.status, d.attempt_count) for d in db.session.query(WebhookDelivery)} == {("succeeded", 1)}
