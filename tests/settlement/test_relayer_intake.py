"""The relayer's intake (backend.settlement.intake, relayer.worker): settlements reach it over a plain Redis list.

A settlement is popped only when a settlement thread is free for it: one pushed while every thread is busy waits
on the list and is taken when a thread frees. A relayer started after the push takes it; ``--burst`` settles
what waits and exits; a relayer outlives a Redis restart; its presence key says it runs, and goes on a clean
stop. Real relayer processes, Anvil, PostgreSQL and Redis; the loop tests run the loop itself in this process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from backend.extensions import db
from backend.queueing import relayer_queue
from backend.settlement import intake
from harness.ready import present_relayers
from harness.redis_server import start_redis as start_private_redis
from payintent.eip3009 import sign_authorization
from relayer import worker
from relayer.pool import SettlementPool
from tests.settlement.conftest import PAYINTENT, make_pay_app, start_relayer, stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, Isolated, iso  # noqa: F401  (fixture)


def _until(check: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


class Loop:
    """relayer.worker._take in a thread, over one list, handing to a pool whose threads run ``run``."""

    def __init__(self, redis: Redis, size: int, run: Callable[[Any], None], *, burst: bool = False) -> None:
        self.base = f"intake-{uuid.uuid4().hex[:8]}"
        self.redis, self.lists = redis, [intake.list_key(self.base, NETWORK)]
        self.pool = SettlementPool(size, run)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=worker._take, args=(self.pool, redis, self.lists), kwargs={"burst": burst, "stop": self.stop.is_set}
        )

    def push(self, *ids: str) -> None:
        for settlement_id in ids:
            intake.push(self.redis, settlement_id, NETWORK, f"req-{settlement_id}", base=self.base)

    def depth(self) -> int:
        return intake.depth(self.redis, self.base, NETWORK)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()


def test_a_settlement_pushed_while_every_thread_is_busy_waits_on_the_list_until_one_frees(redis_url):
    gate, ran = threading.Event(), []

    def run(item: Any) -> None:
        ran.append((item.settlement_id, item.request_id))
        gate.wait(30)

    loop = Loop(Redis.from_url(redis_url), 1, run)
    loop.push("stl_a", "stl_b")
    loop.thread.start()
    try:
        _until(lambda: len(ran) == 1, what="the first settlement handed over")
        time.sleep(1.5)  # more than a BLPOP's wait: the busy relayer did not pop the second one
        assert ran == [("stl_a", "req-stl_a")] and loop.depth() == 1
        gate.set()  # the thread frees
        _until(lambda: len(ran) == 2, what="the second settlement taken once a thread freed")
        assert ran[1] == ("stl_b", "req-stl_b") and loop.depth() == 0
    finally:
        gate.set()
        loop.end()


def test_a_stop_leaves_what_no_thread_could_take_on_the_list(redis_url):
    gate, ran = threading.Event(), []

    def run(item: Any) -> None:
        ran.append(item.settlement_id)
        gate.wait(30)

    loop = Loop(Redis.from_url(redis_url), 2, run)
    loop.push("stl_1", "stl_2", "stl_3", "stl_4")
    loop.thread.start()
    try:
        _until(lambda: len(ran) == 2, what="both threads busy")
        loop.end()  # stopped with every thread busy: nothing popped and left unhanded
        assert sorted(ran) == ["stl_1", "stl_2"]  # first come, first taken
        assert loop.depth() == 2
    finally:
        gate.set()
    assert loop.pool.wait_idle(5)


def test_free_threads_take_several_at_once_and_burst_returns_once_the_list_is_empty(redis_url):
    ran: list[str] = []
    loop = Loop(Redis.from_url(redis_url), 8, lambda item: ran.append(item.settlement_id), burst=True)
    loop.push(*(f"stl_{n}" for n in range(20)))
    loop.thread.start()
    loop.thread.join(timeout=10)
    assert not loop.thread.is_alive()  # burst: back once the list is empty, with no stop asked
    assert loop.pool.wait_idle(5)
    assert sorted(ran) == sorted(f"stl_{n}" for n in range(20)) and loop.depth() == 0


def test_a_pop_takes_no_more_than_it_was_asked_for_across_lists_in_order(redis_url):
    redis = Redis.from_url(redis_url)
    base = f"intake-{uuid.uuid4().hex[:8]}"
    first, second = intake.list_key(base, NETWORK), intake.list_key(base, "eip155:11155111")
    for n in range(3):
        intake.push(redis, f"stl_a{n}", NETWORK, None, base=base)
        intake.push(redis, f"stl_b{n}", "eip155:11155111", None, base=base)
    redis.rpush(second, b"not json")
    items, taken = intake.pop(redis, [first, second], 4, block=1.0)
    # Two free threads' worth and no more: the first list drained in order, then the second's head; the rest waits.
    assert [i.settlement_id for i in items] == ["stl_a0", "stl_a1", "stl_a2", "stl_b0"] and taken == 4
    assert redis.llen(first) == 0 and redis.llen(second) == 3
    items, taken = intake.pop(redis, [first, second], 10, block=None)
    assert [i.settlement_id for i in items] == ["stl_b1", "stl_b2"] and taken == 3  # the unreadable one counted
    assert intake.pop(redis, [first, second], 10, block=None) == ([], 0)
    assert intake.pop(redis, [first, second], 10, block=0.2) == ([], 0)  # waited, nothing came


def test_burst_goes_on_past_a_pop_of_only_unreadable_items(redis_url):
    ran: list[str] = []
    loop = Loop(Redis.from_url(redis_url), 1, lambda item: ran.append(item.settlement_id), burst=True)
    loop.redis.rpush(loop.lists[0], b"not json")  # e.g. written by an older or newer version: dropped, logged
    loop.push("stl_valid")
    loop.thread.start()
    loop.thread.join(timeout=10)
    assert not loop.thread.is_alive()
    assert loop.pool.wait_idle(5)
    assert ran == ["stl_valid"] and loop.depth() == 0  # not left behind as if the list were empty


def test_an_error_reply_to_the_pop_is_waited_out_not_the_end(short_dir):
    redis_proc, url = start_private_redis(short_dir)
    try:
        redis = Redis.from_url(url)
        redis.execute_command("REPLICAOF", "127.0.0.1", "1")  # read-only, as a demoted node after a failover
        ran: list[str] = []
        loop = Loop(redis, 1, lambda item: ran.append(item.settlement_id))
        loop.thread.start()
        time.sleep(1.5)  # its pops answered READONLY
        assert loop.thread.is_alive()  # going on (its one thread given back each time, or the next never runs)
        redis.execute_command("REPLICAOF", "NO", "ONE")
        loop.push("stl_after")
        _until(lambda: ran == ["stl_after"], 10, "taken once Redis takes writes again")
        loop.end()
    finally:
        redis_proc.kill()
        redis_proc.wait()


def _pay_504(iso: Isolated, amount: int, buyer: int = 0) -> dict[str, Any]:  # noqa: F811
    intent = create_intent(iso.client, iso.shop, amount)
    payload = sign_authorization(iso.devnet.buyer(buyer).key, requirement(intent, NETWORK))
    response = pay(iso.client, iso.shop, intent, NETWORK, payload)
    assert response.status_code == 504, response.get_json()  # no relayer takes this queue's settlements yet
    return intent


def test_a_relayer_started_after_the_push_takes_it_and_its_presence_goes_with_a_clean_stop(iso):  # noqa: F811
    redis = Redis.from_url(iso.redis_url)
    intent = _pay_504(iso, 2)
    assert intake.depth(redis, iso.queue, NETWORK) == 1  # waits on the list for a relayer
    relayer = iso.relayer()
    try:
        assert relayer.pid in present_relayers(redis, relayer_queue(iso.queue, NETWORK))
        assert 0 < redis.ttl(intake.alive_key(relayer.pid)) <= intake.ALIVE_TTL_SECONDS  # a dead one's expires
        iso.wait_paid(intent["intent_id"])
        assert intake.depth(redis, iso.queue, NETWORK) == 0
    finally:
        stop_process(relayer)
    assert relayer.returncode == 0
    assert relayer.pid not in present_relayers(redis)  # a clean stop deletes its presence
    assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000


def test_a_burst_relayer_settles_what_waits_and_exits(iso):  # noqa: F811
    redis = Redis.from_url(iso.redis_url)
    intents = [_pay_504(iso, 1, buyer) for buyer in (0, 1)]
    assert intake.depth(redis, iso.queue, NETWORK) == 2
    env = {**os.environ, "DATABASE_URL": iso.db_url, "REDIS_URL": iso.redis_url, "LOG_LEVEL": "WARNING",
           "CHAINS_FILE": iso.devnet.info["chains_file"], "RELAYER_QUEUE": iso.queue}  # fmt: skip
    done = subprocess.run([PAYINTENT, "relayer", "--burst"], env=env, capture_output=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    # It exited after its settlements finished, not merely after the list emptied: both are paid already.
    assert [iso.intent_row(i["intent_id"]).status for i in intents] == ["paid", "paid"]
    assert intake.depth(redis, iso.queue, NETWORK) == 0
    assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for a Redis unix socket (the path of one is limited to about 100 characters)."""
    path = Path(tempfile.mkdtemp(prefix="intake-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_relayer_goes_on_after_redis_restarts(db_url, devnet, short_dir, tmp_path):
    redis_proc, url = start_private_redis(short_dir)
    queue = f"relayer-test-{uuid.uuid4().hex[:8]}"
    app = make_pay_app(db_url, url, devnet, relayer_queue=queue, pay_wait_seconds=20)
    log = tmp_path / "relayer.log"
    relayer = None
    try:
        with app.app_context():
            iso = Isolated(app, queue, db_url, url, devnet)
            relayer = start_relayer(db_url, url, devnet.info["chains_file"], log_file=log, RELAYER_QUEUE=queue)
            first = create_intent(iso.client, iso.shop, 1)
            payload = sign_authorization(devnet.buyer(0).key, requirement(first, NETWORK))
            assert pay(iso.client, iso.shop, first, NETWORK, payload).status_code == 200
            redis_proc.kill()  # Redis goes away under the idle relayer (in its BLPOP)
            redis_proc.wait()
            _until(lambda: "lost Redis" in log.read_text(errors="replace"), what="the relayer noticed")
            time.sleep(1.5)
            assert relayer.poll() is None, log.read_text(errors="replace")[-3000:]
            redis_proc, url = start_private_redis(short_dir)  # back, empty, on the same socket
            # Its presence comes back with the next refresh: readiness and health checks see it again.
            _until(lambda: relayer.pid in present_relayers(Redis.from_url(url)), 15, "the presence back")
            second = create_intent(iso.client, iso.shop, 2)
            payload = sign_authorization(devnet.buyer(1).key, requirement(second, NETWORK))
            response = pay(iso.client, iso.shop, second, NETWORK, payload)
            assert response.status_code == 200, (response.get_json(), log.read_text(errors="replace")[-3000:])
            iso.wait_paid(second["intent_id"])
            assert devnet.balance(NETWORK, iso.payout) == 3_000_000  # the same relayer process settled both
            db.session.remove()
    finally:
        if relayer is not None:
            stop_process(relayer)
        with app.app_context():
            db.engine.dispose()
        redis_proc.kill()
        redis_proc.wait()
