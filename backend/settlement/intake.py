"""The relayer's intake: settlement ids on a plain Redis list per network, and the relayers' presence.

A settlement id on a list only wakes a relayer (backend.queueing: queues only wake workers; the database holds
every durable fact). ``/pay`` (settlement.flow.enqueue_settlement) and the reconciler push; a relayer pops an id
only when one of its settlement threads is free for it (relayer.worker), so a stop leaves nothing popped and
not handed over. A relayer that crashes may lose the ids it popped, and so may a pop whose reply Redis sent
but the relayer never got (a dropped connection or a reply later than the socket timeout: redis-py retries the
command, and the retry pops other ids). Either way their settlements stay open in the database and the
reconciler pushes them again once STALE_AFTER old, as it did for a lost RQ job.

One list per network, ``payintent:intake:<RELAYER_QUEUE>:<network>`` (its name after the prefix is
backend.queueing.relayer_queue's), pushed on the right and popped on the left: first come, first settled.
Each item is JSON ``{"id": settlement id, "rid": the /pay call's request id}`` (the relayer's log lines for the
settlement carry it).

A relayer keeps :data:`ALIVE_KEY` (its host and pid) while it runs, holding the queues it takes settlements of
and refreshed before its TTL runs out (a dead relayer's key expires), deleted on a clean stop: readiness waits
(harness.ready), the drills and deploy/healthcheck.py read it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError

from backend.queueing import relayer_queue

log = logging.getLogger(__name__)

LIST_PREFIX = "payintent:intake:"
ALIVE_KEY = "payintent:relayer:alive:{host}:{pid}"  # deploy/healthcheck.py and harness/ready.py know it too
ALIVE_TTL_SECONDS = 15
ALIVE_REFRESH_SECONDS = 5.0


def list_key(base: str, network: str) -> str:
    """The list of ``network``'s settlements waiting for a relayer (``base``: RELAYER_QUEUE)."""
    return LIST_PREFIX + relayer_queue(base, network)


def push(redis: Redis, settlement_id: str, network: str, request_id: str | None, *, base: str) -> None:
    """Wake a relayer of ``network`` for this settlement: one RPUSH."""
    redis.rpush(list_key(base, network), json.dumps({"id": settlement_id, "rid": request_id}))


@dataclass(frozen=True)
class Item:
    settlement_id: str
    request_id: str | None


def _item(raw: bytes | str) -> Item | None:
    try:
        data = json.loads(raw)
        return Item(str(data["id"]), data.get("rid"))
    except (ValueError, KeyError, TypeError):
        log.error("intake: dropped an unreadable item %r", raw[:200])
        return None


def pop(redis: Redis, lists: Sequence[str], most: int, *, block: float | None) -> tuple[list[Item], int]:
    """Up to ``most`` items (``most`` >= 1) from ``lists``: the first waiting up to ``block`` seconds (BLPOP across
    the lists; None: not waiting), the rest only if already there (LPOP with a count, list by list).

    Returns the readable items and how many were taken off the lists, unreadable ones (logged, dropped) included:
    0 only when the lists were empty."""
    got: list[bytes | str] = []
    if block is not None:
        first = redis.blpop(list(lists), timeout=block)
        if first is None:
            return [], 0
        got.append(first[1])
    try:
        for key in lists:
            if len(got) >= most:
                break
            more = redis.lpop(key, most - len(got))
            if isinstance(more, list):  # with a count: a list, or None when empty
                got.extend(more)
    except RedisError:
        if not got:
            raise
        # What was taken is handed over; the caller meets the error at its next pop.
    return [item for item in map(_item, got) if item is not None], len(got)


def depth(redis: Redis, base: str, network: str) -> int:
    """How many settlements of ``network`` wait on its list (the metric payintent_queue_depth)."""
    return int(redis.llen(list_key(base, network)))


def alive_key(pid: int | None = None, host: str | None = None) -> str:
    return ALIVE_KEY.format(host=host or socket.gethostname(), pid=os.getpid() if pid is None else pid)


class Presence:
    """This relayer's :data:`ALIVE_KEY`, set now and refreshed by a daemon thread until :meth:`close` deletes it.
    Redis errors are let pass (the next refresh sets it again)."""

    def __init__(self, redis: Redis, queues: Sequence[str], lists: Sequence[str]) -> None:
        self._redis = redis
        self._key = alive_key()
        self._value = json.dumps({"queues": list(queues), "lists": list(lists)})
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="relayer-alive", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        with contextlib.suppress(RedisError):
            self._redis.set(self._key, self._value, ex=ALIVE_TTL_SECONDS)

    def _loop(self) -> None:
        while not self._stop.wait(ALIVE_REFRESH_SECONDS):
            self._beat()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with contextlib.suppress(RedisError):  # else it expires
            self._redis.delete(self._key)
