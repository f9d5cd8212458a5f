"""Waiting costs no worker: /pay calls waiting for the chain leave `payintent serve` answering everyone else.

The real API (`payintent serve`, one gunicorn worker of 40 threads), a real relayer, a real Anvil chain that
stops mining: 32 signed payments are sent at once and all wait (the relayer's first transaction sits in the
node's pool, the others in the queue). Meanwhile reads and intent creation still answer at once. Then the chain
mines again and every payment settles exactly once, the balances on chain moved by exactly the amounts.
Under gunicorn's sync workers (one request per worker) the same reads would wait behind the payments.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from redis import Redis
from sqlalchemy import func, select

from backend.extensions import db
from backend.settlement.flow import client_socket_timeout, notify_settled, wait_settled
from backend.settlement.models import Settlement
from devnet.anvil import rpc
from harness.ready import wait_healthy
from payintent.eip3009 import sign_authorization
from tests.conftest import free_port
from tests.settlement.conftest import PAYINTENT, stop_process
from tests.settlement.test_pay import INTENTS, PAY, requirement
from tests.settlement.test_recovery import NETWORK, Isolated, iso

__all__ = ["iso"]

PAYMENTS = 32
THREADS = 40
PAY_WAIT_SECONDS = 90  # only a failing run waits this long: a settled payment answers at once
QUICK = 2.0  # seconds a read or a create may take while the payments wait (generous: it takes milliseconds)


@pytest.fixture
def api(iso: Isolated, tmp_path: Path) -> Iterator[str]:
    """`payintent serve --workers 1 --threads 40` on the test's database, Redis and relayer queue."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": iso.db_url, "REDIS_URL": iso.redis_url,
           "CHAINS_FILE": iso.devnet.info["chains_file"], "RELAYER_QUEUE": iso.queue,
           "PAY_WAIT_SECONDS": str(PAY_WAIT_SECONDS), "LOG_LEVEL": "WARNING", "SECRET_KEY": "pay-waits-test-key",
           "PAYINTENT_VAR_DIR": str(tmp_path / "var"),
           # Not under test: the limits that would refuse 32 payments of one merchant and three payers at once.
           "MAX_OPEN_SETTLEMENTS": "0", "MAX_OPEN_SETTLEMENTS_PER_PAYER": "0", "RELAY_BUDGET_EVM": "unlimited",
           "API_RATE_LIMIT_PER_KEY": "0", "API_RATE_LIMIT_PER_IP": "0"}  # fmt: skip
    with (tmp_path / "serve.log").open("wb") as out:
        proc = subprocess.Popen(
            [PAYINTENT, "serve", "--port", str(port), "--workers", "1", "--threads", str(THREADS)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc])
        yield base
    finally:
        stop_process(proc)
        log = (tmp_path / "serve.log").read_text()
        assert "Traceback" not in log, log


@pytest.fixture
def frozen(iso: Isolated) -> Iterator[str]:
    """The chain mines nothing (no automine, no interval mining) until the test says so; mining again after."""
    url = iso.devnet.info["networks"][NETWORK]["rpc_url"]
    rpc(url, "evm_setIntervalMining", [0])
    rpc(url, "evm_setAutomine", [False])
    try:
        yield url
    finally:
        rpc(url, "evm_setAutomine", [True])
        rpc(url, "evm_mine")


def timed(method: str, url: str, **kwargs: Any) -> tuple[requests.Response, float]:
    started = time.monotonic()
    response = requests.request(method, url, timeout=30, **kwargs)
    return response, time.monotonic() - started


def claimed(intent_ids: list[str]) -> int:
    db.session.expire_all()
    count = db.session.scalar(select(func.count()).select_from(Settlement).where(Settlement.intent_id.in_(intent_ids)))
    db.session.rollback()
    return int(count or 0)


def test_payments_waiting_for_the_chain_leave_the_api_answering_and_all_settle_once(iso, api, frozen, tmp_path):
    headers = iso.shop.headers
    buyers = [iso.devnet.buyer(n) for n in range(3)]
    intents, bodies, owed = [], [], Counter[str]()
    for n in range(PAYMENTS):
        amount = 1_000_000 + n * 10_000  # 1.00, 1.01, ... USDC: each payment its own amount
        created, _ = timed("POST", f"{api}{INTENTS}", json={"amount_usdc": amount / 1_000_000}, headers=headers)
        assert created.status_code == 201, created.text
        intent = created.json()["data"]
        buyer = buyers[n % len(buyers)]
        payload = sign_authorization(buyer.key, requirement(intent, NETWORK))
        intents.append(intent["intent_id"])
        bodies.append({"intent_id": intent["intent_id"], "payment_signature": {
            "scheme": "exact", "network": NETWORK, "x402Version": 1, "payload": payload}})  # fmt: skip
        owed[buyer.address] += amount
    before = {address: iso.devnet.balance(NETWORK, address) for address in owed}
    relayer = iso.relayer()
    try:
        with ThreadPoolExecutor(PAYMENTS) as pool:
            paying: list[Future[requests.Response]] = [
                pool.submit(requests.post, f"{api}{PAY}", json=body, headers=headers, timeout=PAY_WAIT_SECONDS + 60)
                for body in bodies
            ]
            deadline = time.monotonic() + 60
            while claimed(intents) < PAYMENTS:  # every payment checked and claimed: each waits for the relayer now
                assert time.monotonic() < deadline, f"{claimed(intents)} of {PAYMENTS} payments claimed"
                assert not [f for f in paying if f.done()], [f.result().text for f in paying if f.done()]
                time.sleep(0.1)
            for _ in range(3):
                read, read_took = timed("GET", f"{api}{INTENTS}/{intents[0]}", headers=headers)
                assert read.status_code == 200 and read.json()["data"]["status"] == "pending", read.text
                made, made_took = timed("POST", f"{api}{INTENTS}", json={"amount_usdc": 2}, headers=headers)
                assert made.status_code == 201, made.text
                assert read_took < QUICK and made_took < QUICK, (read_took, made_took)
                time.sleep(0.2)
            assert not [f for f in paying if f.done()]  # still waiting: the chain has mined nothing
            rpc(frozen, "evm_setAutomine", [True])
            rpc(frozen, "evm_mine")  # the relayer's first transaction, sent while frozen
            answers = [f.result() for f in paying]
    finally:
        stop_process(relayer)
    logged = (tmp_path / "serve.log").read_text()
    assert [a.status_code for a in answers] == [200] * PAYMENTS, ([a.text for a in answers if a.status_code != 200],
                                                                   logged)  # fmt: skip
    tx_hashes = [a.json()["data"]["tx_hash"] for a in answers]
    assert len(set(tx_hashes)) == PAYMENTS
    for intent_id, tx_hash in zip(intents, tx_hashes, strict=True):
        row = iso.intent_row(intent_id)
        assert row.status == "paid" and row.tx_hash == tx_hash
        assert iso.settlement(intent_id).tx_hash == tx_hash  # one settlement per intent (.one())
        assert len(iso.completed_events(intent_id)) == 1
        receipt = iso.devnet.w3(NETWORK).eth.get_transaction_receipt(tx_hash)
        assert receipt["status"] == 1
    assert iso.devnet.balance(NETWORK, iso.payout) == sum(owed.values())
    for address, amount in owed.items():
        assert before[address] - iso.devnet.balance(NETWORK, address) == amount


def test_the_wait_outlasts_the_redis_clients_socket_timeout(redis_url):
    """/pay waits PAY_WAIT_SECONDS, not the client's socket timeout (redis-py's default: 5 s), which a single
    BLPOP longer than it runs into (TimeoutError): the word that comes after the socket timeout is seen."""
    redis = Redis.from_url(redis_url, socket_timeout=1)
    settlement_id = f"stl_{uuid.uuid4().hex}"
    started = time.monotonic()
    assert not wait_settled(redis, settlement_id, 1.5)  # no word: the whole wait, no error
    assert time.monotonic() - started >= 1.5
    later = threading.Timer(1.8, notify_settled, (Redis.from_url(redis_url), settlement_id))
    later.start()
    try:
        assert wait_settled(redis, settlement_id, 30)
    finally:
        later.cancel()


def test_the_wait_knows_the_default_socket_timeout() -> None:
    """A client made from a URL alone (the app's) still has redis-py's default socket timeout, which ``from_url``
    leaves out of ``connection_kwargs``: the wait must see it, or its one long BLPOP raised TimeoutError after 5 s
    and /pay answered 504 SETTLEMENT_PENDING then (the rpcloss drill: "queue unavailable ... Timeout reading from
    socket" for every settlement the relayer had not finished within 5 s)."""
    for url in ("redis://127.0.0.1:6379/0", "unix:///tmp/redis.sock"):
        client = Redis.from_url(url)
        assert client_socket_timeout(client) == client.connection_pool.make_connection().socket_timeout
        assert client_socket_timeout(Redis.from_url(url, socket_timeout=1)) == 1
        assert client_socket_timeout(Redis.from_url(url, socket_timeout=None)) is None
