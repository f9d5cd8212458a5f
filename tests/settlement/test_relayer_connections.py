"""A relayer's settlement threads and PostgreSQL's connections (docs/benchmarks.md, blocks2-256).

With 4 relayers x 32 threads, each thread's finish after its receipt asked for a connection when a block mined
them all, PostgreSQL answered "too many clients", the finish raised and nothing retried it: the payment was on
chain and unrecorded until the reconciler. Now a settlement meets such trouble with a few tries in its thread, and
a thread holds no connection while it waits on the chain, so a relayer's threads share a smaller pool.

The relayer connects as a PostgreSQL role of its own (a member of the test's role, so it may use its tables): the
test refuses its connections (CONNECTION LIMIT 0: "too many connections for role", SQLSTATE 53300 as "too many
clients") and counts them in pg_stat_activity. Real Anvil, a real relayer process, real PostgreSQL and Redis.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from redis import Redis

from backend import appstate
from backend.app import RELAYER_POOL_SIZE
from backend.appstate import SETTINGS_KEY
from backend.settlement import intake
from devnet.anvil import rpc
from payintent.eip3009 import sign_authorization
from relayer.tasks import JOB_LOCK_KEY
from tests.settlement.conftest import start_relayer, stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_payer_code import funded_buyer, relay_nonces, settlement_of
from tests.settlement.test_recovery import NETWORK, Isolated, _token, iso
from tests.settlement.test_relay_transient import _sign, chain_clock
from tests.settlement.test_relayer_threads import _in_pool, _wait, freeze

__all__ = ["chain_clock", "freeze", "iso"]

pytestmark = [pytest.mark.db, pytest.mark.redis]


@dataclasses.dataclass
class Role:
    """The relayer's own PostgreSQL role: its URL, and what the test does to its connections."""

    name: str
    url: str
    admin: sa.Engine

    def sql(self, statement: str) -> Any:
        with self.admin.connect() as connection:
            result = connection.exec_driver_sql(statement)
            return result.all() if result.returns_rows else None

    def refuse_connections(self) -> None:
        """New connections are refused, the open ones (idle in the pool) ended: the next use needs a new one."""
        self.sql(f'ALTER ROLE "{self.name}" CONNECTION LIMIT 0')
        self.sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{self.name}'")

    def accept_connections(self) -> None:
        self.sql(f'ALTER ROLE "{self.name}" CONNECTION LIMIT -1')

    def connections(self) -> tuple[int, int]:
        """The role's open connections, and of them those in use (in a transaction, or running a statement)."""
        ((total, in_use),) = self.sql(
            "SELECT count(*), count(*) FILTER (WHERE state <> 'idle') FROM pg_stat_activity "
            f"WHERE usename = '{self.name}' AND backend_type = 'client backend'"
        )
        return int(total), int(in_use)


@pytest.fixture
def role(iso: Isolated) -> Iterator[Role]:
    if not iso.db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL's connections: its roles and pg_stat_activity")
    admin = sa.create_engine(iso.db_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    name = f"relayer_{uuid.uuid4().hex[:8]}"
    with admin.connect() as connection:
        owner = connection.exec_driver_sql("SELECT current_user").scalar_one()
        connection.exec_driver_sql(f'CREATE ROLE "{name}" LOGIN NOSUPERUSER IN ROLE "{owner}"')
    made = Role(name, sa.make_url(iso.db_url).set(username=name).render_as_string(hide_password=False), admin)
    try:
        yield made
    finally:
        made.sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'")
        made.sql(f'DROP ROLE IF EXISTS "{name}"')
        admin.dispose()


def _relayer(iso: Isolated, role: Role, log_file: Path | None = None, **env: str) -> Any:
    return start_relayer(
        role.url, iso.redis_url, iso.devnet.info["chains_file"], log_file=log_file, RELAYER_QUEUE=iso.queue, **env
    )


def test_a_finish_refused_a_connection_is_tried_again_and_the_mined_payment_is_recorded_once(
    iso: Isolated, role: Role, freeze: Callable[[], str], tmp_path: Path
) -> None:
    amount = 3_000_000
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, amount)
    intent = create_intent(iso.client, iso.shop, amount / 1_000_000)
    log = tmp_path / "relayer.log"
    relayer = _relayer(iso, role, log_file=log)  # its own file (the shared test log gets a per-worker suffix)
    try:
        frozen = freeze()
        sent_before = sum(relay_nonces(w3, iso.devnet).values())
        payload = sign_authorization(buyer.key, requirement(intent, NETWORK))
        response = pay(iso.client, iso.shop, intent, NETWORK, payload)
        assert response.status_code == 504, response.get_json()  # sent; the chain mines nothing
        _wait(lambda: _in_pool(w3, iso.devnet) == 1, 60, "the transaction in the node's pool")
        # The thread waits for its receipt; when it comes, its finish finds no connection to record it with.
        role.refuse_connections()
        rpc(frozen, "evm_mine")
        deadline = time.monotonic() + 30
        while "trying again" not in _text(log):  # before the fix: "failed", and the settlement left open
            assert time.monotonic() < deadline, f"the relayer never tried the finish again; its log: {_text(log)}"
            time.sleep(0.2)
        assert iso.devnet.balance(NETWORK, iso.payout) == amount  # on chain ...
        assert settlement_of(intent["intent_id"]).status == "submitted"  # ... not recorded yet
        role.accept_connections()
        paid = iso.wait_paid(intent["intent_id"], timeout=60)  # no reconciler runs: the relayer's own retry
    finally:
        role.accept_connections()
        stop_process(relayer)
    assert paid.tx_hash is not None
    assert iso.devnet.balance(NETWORK, iso.payout) == amount  # moved once
    assert iso.devnet.balance(NETWORK, buyer.address) == 0
    assert sum(relay_nonces(w3, iso.devnet).values()) - sent_before == 1  # one transaction
    assert len(iso.completed_events(intent["intent_id"])) == 1
    text = _text(log)
    assert "too many connections for role" in text  # what PostgreSQL said, in the retry's one-line warning
    assert "Traceback" not in text and f"{paid.settlement_id}: failed" not in text


class _Sampler:
    """The role's most connections, open and in use, seen while it runs (every 50 ms, in a thread)."""

    def __init__(self, role: Role) -> None:
        self.role, self.most_open, self.most_in_use = role, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            total, in_use = self.role.connections()
            self.most_open, self.most_in_use = max(self.most_open, total), max(self.most_in_use, in_use)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_settlement_threads_waiting_on_the_chain_hold_no_connection_and_share_a_smaller_pool(
    iso: Isolated, role: Role, freeze: Callable[[], str], chain_clock: Callable[[int], None]
) -> None:
    """12 threads wait for the chain (its clock to pass validAfter, then their receipts): before the fix each held
    a connection in a read transaction while it waited before the send (12 in use); now none does, and when
    one block finishes all 12, they share at most RELAYER_POOL_SIZE connections."""
    count, amount = 12, 1_000_000
    assert count > RELAYER_POOL_SIZE
    iso.app.config[SETTINGS_KEY] = dataclasses.replace(appstate.settings(iso.app), pay_wait_seconds=0.2)
    w3, token = _token(iso.devnet, NETWORK)
    buyers = [funded_buyer(w3, token, iso.devnet, amount) for _ in range(count)]
    intents = [create_intent(iso.client, iso.shop, amount / 1_000_000) for _ in buyers]
    started = int(time.time())
    chain_clock(started)
    for intent, buyer in zip(intents, buyers, strict=True):  # claimed, none sent: no relayer yet
        # validAfter against the chain's clock as set (no block is mined here: a loaded machine's 12 /pays can
        # take more than 5 s, and a validAfter from the wall clock then passes the chain's latest block).
        payload = _sign(buyer, requirement(intent, NETWORK), started - 5)
        response = pay(iso.client, iso.shop, intent, NETWORK, payload)
        assert response.status_code == 504, response.get_json()
    frozen = freeze()
    chain_clock(int(time.time()) - 30)  # the chain's latest block is before validAfter: every thread waits (10 s)
    redis = Redis.from_url(iso.redis_url)
    locks = [JOB_LOCK_KEY.format(settlement_of(i["intent_id"]).id) for i in intents]
    relayer = _relayer(iso, role, RELAYER_THREADS=str(count))
    try:
        # Every settlement taken off the list by a thread (each holds its settlement's lock), none finished: all 12
        # threads wait for the chain's clock.
        _wait(lambda: intake.depth(redis, iso.queue, NETWORK) == 0 and redis.exists(*locks) == count, 30,
              "every settlement handed to a thread")  # fmt: skip
        # The 12 start at once (taken together off the list), 10 connections for 12 first reads: once those are
        # done, none is in use while they wait (before the fix: one per waiting thread, never 0). Done means none
        # in use for 0.5 s on end: one look at 0 can fall between two reads of a thread a loaded machine slows.
        _wait(lambda: _none_in_use_for(role, 0.5), 8, "the threads' first reads done")
        with _Sampler(role) as waiting_for_clock:
            time.sleep(2)
        assert redis.exists(*locks) == count  # still waiting, all of them (a finished one frees its lock)
        chain_clock(int(time.time()) + 1)  # validAfter passed: each sends, and waits for its receipt
        _wait(lambda: _in_pool(w3, iso.devnet) == count, 60, "every payment's transaction in the node's pool")
        with _Sampler(role) as waiting_for_receipts:
            time.sleep(1)
        with _Sampler(role) as finishing:
            rpc(frozen, "evm_mine")  # one block finishes all 12 at once
            for intent in intents:
                iso.wait_paid(intent["intent_id"], timeout=90)
    finally:
        stop_process(relayer)
    assert waiting_for_clock.most_in_use < count, "before the fix: a connection per waiting thread"
    assert waiting_for_clock.most_in_use == 0 and waiting_for_receipts.most_in_use == 0
    assert finishing.most_open <= RELAYER_POOL_SIZE  # 12 threads finishing together: never 12 connections
    assert iso.devnet.balance(NETWORK, iso.payout) == amount * count  # each moved once
    assert all(iso.devnet.balance(NETWORK, buyer.address) == 0 for buyer in buyers)
    assert all(len(iso.completed_events(i["intent_id"])) == 1 for i in intents)


def _none_in_use_for(role: Role, seconds: float) -> bool:
    """Whether none of the role's connections was in use at any look (every 50 ms) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if role.connections()[1]:
            return False
        time.sleep(0.05)
    return True


def _text(log: Path) -> str:
    """The relayer's log so far: none yet until it first writes (a loaded machine starts it slowly)."""
    return log.read_text() if log.exists() else ""
