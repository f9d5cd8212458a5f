"""What the relayer tries again, and what it does not (hostile review, L2 and HIGH item 3).

``enqueue_settlement`` once asked RQ to retry a failed settle job, a retry no scheduler ran. Settlements now
reach the relayer as items on a plain Redis list (backend.settlement.intake), with no retry of their own: the
reconciler, which sends again every settlement left open past ``STALE_AFTER``, is the one retry path of a
failed settlement (its re-sending is tested in test_recovery.py). Within a job, the settlement thread tries again
on passing trouble only (``relayer.tasks._transient``; its retry is tested in test_relayer_connections.py).
"""

from __future__ import annotations

import contextlib
import logging
import uuid

import pytest
from redis import Redis
from rq import Queue
from sqlalchemy.exc import OperationalError

from backend.queueing import relayer_queue
from backend.settlement import intake
from backend.settlement.flow import enqueue_settlement


@contextlib.contextmanager
def logs_request(request_id: str):
    from backend import logs

    with logs.job_context(request_id):
        yield


def test_a_settlement_reaches_the_relayer_as_one_list_item_not_an_rq_job(redis_url):
    """One RPUSH on the network's intake list, carrying the request id; nothing for RQ (no job, no retry that a
    scheduler would have to run: the reconciler is the one retry path)."""
    redis = Redis.from_url(redis_url)
    name, settlement_id = f"relayer-retry-{uuid.uuid4().hex[:8]}", f"stl_{uuid.uuid4().hex[:12]}"
    with logs_request("req-intake-1"):
        enqueue_settlement(redis, settlement_id, name, "eip155:84532")
    key = intake.list_key(name, "eip155:84532")
    assert key == f"payintent:intake:{relayer_queue(name, 'eip155:84532')}"  # never one of RQ's keys (rq:...)
    assert intake.depth(redis, name, "eip155:84532") == 1
    assert Queue(relayer_queue(name, "eip155:84532"), connection=redis).count == 0
    assert intake.pop(redis, [key], 5, block=None) == ([intake.Item(settlement_id, "req-intake-1")], 1)
    assert intake.pop(redis, [key], 5, block=0.1) == ([], 0)  # empty: BLPOP times out


def test_what_ends_a_settlement_and_what_is_tried_again():
    """A node's answer that the transfer cannot succeed ends the settlement (``rails.evm.relay.final_refusal``);
    anything that may pass on another try (a timeout, a nonce race, a relay short of ETH) does not."""
    import requests
    from web3.exceptions import ContractLogicError, Web3RPCError

    from backend.rails.evm.relay import final_refusal

    final = [
        ContractLogicError("execution reverted: FiatTokenV2: invalid signature"),
        Web3RPCError("execution reverted"),
        Web3RPCError("gas required exceeds allowance (120000)"),
        ValueError("FiatTokenV2: authorization is used or canceled"),
        Web3RPCError("out of gas"),
    ]
    transient = [
        requests.exceptions.ReadTimeout("read timed out"),
        requests.exceptions.ConnectionError("connection refused"),
        Web3RPCError("nonce too low"),
        Web3RPCError("replacement transaction underpriced"),
        Web3RPCError("insufficient funds for gas * price + value"),
        RuntimeError("execution reverted"),  # not the node's answer
    ]
    assert all(final_refusal(exc) for exc in final)
    assert not any(final_refusal(exc) for exc in transient)


def test_a_settlement_thread_tries_again_passing_trouble_never_a_decision():
    """Too many clients, a dropped connection, the pool's wait, a chain or Redis unreachable pass; a 4xx catalog
    error (the payment cannot succeed), a failing statement or a Redis command refused do not."""
    import requests
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    from backend.errors import DomainError
    from relayer.tasks import _transient

    passing = [
        OperationalError("SELECT 1", {}, Exception("FATAL:  sorry, too many clients already")),
        PoolTimeout("QueuePool limit of size 10 overflow 0 reached, connection timed out, timeout 10.00"),
        DomainError("CHAIN_UNAVAILABLE", "eip155:84532 cannot be reached right now; try again"),
        RedisConnectionError("Connection refused"),
        requests.exceptions.ConnectionError("connection refused"),
        requests.exceptions.ReadTimeout("read timed out"),
    ]
    decisions = [
        DomainError("INVALID_REQUEST", "no"),
        IntegrityError("INSERT", {}, Exception("duplicate key value")),
        ProgrammingError("SELECT", {}, Exception("syntax error")),
        ResponseError("WRONGTYPE"),
        ValueError("FiatTokenV2: authorization is used or canceled"),
    ]
    assert all(_transient(exc) for exc in passing)
    assert not any(_transient(exc) for exc in decisions)


def test_passing_trouble_is_tried_again_until_the_deadline_and_never_without_the_lock(monkeypatch, caplog):
    """With the clock injected: tries back off up to SETTLE_RETRY_SECONDS, the warning is said once (a database
    outage meets every thread), and a lock found lost after a backoff stops the tries at once."""
    from relayer import tasks

    now = [1000.0]
    monkeypatch.setattr(tasks.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(tasks.time, "sleep", lambda seconds: now.__setitem__(0, now[0] + seconds))
    tries: list[float] = []

    def refused(settlement_id: str, redis: object) -> str:
        tries.append(now[0])
        raise OperationalError("SELECT 1", {}, Exception("FATAL: sorry, too many clients already"))

    monkeypatch.setattr(tasks, "_settle", refused)
    caplog.set_level(logging.DEBUG, logger=tasks.log.name)
    with pytest.raises(OperationalError):
        tasks._settle_retrying("stl_x", None, lambda: True)  # type: ignore[arg-type]
    assert len(tries) > 5 and tries[-1] - tries[0] <= tasks.SETTLE_RETRY_SECONDS
    assert [r.levelno for r in caplog.records if "trying again" in r.message].count(logging.WARNING) == 1
    tries.clear()
    with pytest.raises(OperationalError):
        tasks._settle_retrying("stl_x", None, lambda: False)  # type: ignore[arg-type]
    assert len(tries) == 1  # the lock is not ours any more: never settled again from here
