"""The settle job's retry path (hostile review, L2).

``enqueue_settlement`` asked RQ to retry a failed settle job after 1, 3 and 10 s. RQ parks such a retry
in its ScheduledJobRegistry for a scheduler to move back, and the relayer runs its workers without one
(``backend.queueing.work``: ``with_scheduler=False``): the retries never ran. They are gone; the
reconciler, which sends again every settlement left open past ``STALE_AFTER``, is the one retry path
(its re-sending is tested in test_recovery.py).
"""

from __future__ import annotations

import inspect
import uuid

from redis import Redis
from rq import Queue

from backend import queueing
from backend.queueing import relayer_queue
from backend.settlement.flow import enqueue_settlement


def test_a_settle_job_promises_no_retry_that_no_scheduler_would_run(redis_url):
    redis = Redis.from_url(redis_url)
    name, settlement_id = f"relayer-retry-{uuid.uuid4().hex[:8]}", f"stl_{uuid.uuid4().hex[:12]}"
    enqueue_settlement(redis, settlement_id, name, "eip155:84532")
    queue = Queue(relayer_queue(name, "eip155:84532"), connection=redis)
    job = queue.fetch_job(f"settle-{settlement_id}")
    assert job is not None
    assert not job.retries_left and not job.retry_intervals  # nothing RQ would park for a scheduler
    # ... and indeed no worker of ours runs RQ's scheduler, which is why such a retry never ran.
    assert "with_scheduler=False" in inspect.getsource(queueing._work)
    queue.empty()
