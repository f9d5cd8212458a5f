"""Exactly once through crashes: the relayer or the API dies mid-way and the intent still ends paid once.

These tests use their own relayer queue, so the session's relayer never picks up their jobs; each
starts (and kills) relayer processes of its own, with fault injection (PAYINTENT_FAULT).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from redis import Redis
from sqlalchemy import select, update

from backend import clock as clock_module
from backend.events.models import Event
from backend.extensions import db
from backend.intents.models import Intent
from backend.intents.services import expire_overdue
from backend.queueing import relayer_queue
from backend.rails.evm import relay as evm_relay
from backend.settlement.models import Settlement
from backend.settlement.reconcile import reconcile
from harness.ready import present_relayers
from payintent.eip3009 import sign_authorization
from relayer.faults import CRASH_EXIT_CODE
from tests.conftest import create_merchant, free_port
from tests.settlement.conftest import PAYINTENT, make_pay_app, start_relayer, stop_process
from tests.settlement.test_pay import INTENTS, create_intent, pay, requirement

NETWORK = "eip155:84532"


class Isolated:
    def __init__(self, app: Any, queue: str, db_url: str, redis_url: str, devnet: Any) -> None:
        self.app, self.queue, self.db_url, self.redis_url, self.devnet = app, queue, db_url, redis_url, devnet
        self.client = app.test_client()
        self.payout = __import__("eth_account").Account.create().address
        self.shop = create_merchant(app, f"iso-{uuid.uuid4().hex[:8]}@example.com",
                                    {n: self.payout for n in devnet.networks})  # fmt: skip

    def relayer(self, fault: str | None = None, **env: str) -> subprocess.Popen[bytes]:
        extra = {"RELAYER_QUEUE": self.queue, **({"PAYINTENT_FAULT": fault} if fault else {}), **env}
        return start_relayer(self.db_url, self.redis_url, self.devnet.info["chains_file"], **extra)

    def intent_row(self, intent_id: str) -> Intent:
        db.session.expire_all()
        row = db.session.get(Intent, intent_id)
        assert row is not None
        return row

    def settlement(self, intent_id: str) -> Settlement:
        db.session.expire_all()
        return db.session.scalars(select(Settlement).where(Settlement.intent_id == intent_id)).one()

    def completed_events(self, intent_id: str) -> list[dict[str, Any]]:
        rows = db.session.scalars(
            select(Event).where(Event.type == "payment.completed", Event.intent_id == intent_id)
        ).all()
        return [json.loads(r.payload) for r in rows]

    def reconcile_later(self, seconds: int = 60) -> dict[str, int]:
        """Run the reconciler as if ``seconds`` had passed (it only looks at settlements left alone)."""
        later = datetime.now(UTC) + timedelta(seconds=seconds)
        clock_module.set_clock(lambda: later)
        try:
            return reconcile(self.devnet.chains, Redis.from_url(self.redis_url), self.queue)
        finally:
            clock_module.set_clock(None)

    # The waits' deadlines are generous: a loaded machine (the suite runs on 4 xdist workers) may take tens of
    # seconds to start a relayer; a deadline only bounds how long a failing test takes.
    def wait_settlement(self, intent_id: str, status: str, timeout: float = 90) -> Settlement:
        deadline = time.monotonic() + timeout
        while (settlement := self.settlement(intent_id)).status != status:
            assert time.monotonic() < deadline, f"settlement is {settlement.status}, not {status}"
            time.sleep(0.1)
        return settlement

    def wait_paid(self, intent_id: str, timeout: float = 90) -> Intent:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            row = self.intent_row(intent_id)
            if row.status == "paid":
                return row
            time.sleep(0.1)
        raise AssertionError(f"intent {intent_id} did not become paid")


@pytest.fixture
def iso(db_url: str, redis_server_url: str, devnet: Any) -> Iterator[Isolated]:
    queue = f"relayer-test-{uuid.uuid4().hex[:8]}"
    # The devnet and Redis are shared by the tests of this xdist worker, and no relayer of an earlier test is alive
    # now; but one killed at a crash point inside its send (after-mark-submitted) left its relay-account lease in
    # Redis for LEASE_SECONDS. A test that needs that account (the one funded account of
    # test_drained_relay_accounts...) then waited on it and timed out, depending on test order: free them.
    redis = Redis.from_url(redis_server_url)
    stale = list(redis.scan_iter(match=evm_relay.LEASE_KEY.format("*", "*")))
    if stale:
        redis.delete(*stale)
    app = make_pay_app(db_url, redis_server_url, devnet, relayer_queue=queue, pay_wait_seconds=3)
    with app.app_context():
        yield Isolated(app, queue, db_url, redis_server_url, devnet)
        db.session.remove()
        db.engine.dispose()


def test_relayer_killed_after_broadcast_ends_paid_once(iso):
    intent = create_intent(iso.client, iso.shop, 4)
    payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK))
    crashing = iso.relayer(fault="after-broadcast")
    try:
        response = pay(iso.client, iso.shop, intent, NETWORK, payload)
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    assert response.status_code == 504
    assert response.get_json()["error"]["code"] == "SETTLEMENT_PENDING"
    assert iso.devnet.balance(NETWORK, iso.payout) == 4_000_000  # the chain moved the money
    assert iso.intent_row(intent["intent_id"]).status == "pending"  # ... but nobody recorded it yet
    assert iso.reconcile_later()["finished"] == 1
    row = iso.intent_row(intent["intent_id"])
    assert row.status == "paid" and row.tx_hash == iso.settlement(intent["intent_id"]).tx_hash
    assert len(iso.completed_events(intent["intent_id"])) == 1
    assert iso.reconcile_later()["finished"] == 0  # nothing left to do
    assert len(iso.completed_events(intent["intent_id"])) == 1
    assert iso.devnet.balance(NETWORK, iso.payout) == 4_000_000


def test_relayer_killed_before_broadcast_is_sent_again(iso):
    intent = create_intent(iso.client, iso.shop, 2)
    payload = sign_authorization(iso.devnet.buyer(1).key, requirement(intent, NETWORK))
    crashing = iso.relayer(fault="after-mark-submitted")
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    assert iso.devnet.balance(NETWORK, iso.payout) == 0  # recorded as submitted, never sent
    # Its recorded nonce is unconsumed: sent again only at that (account, nonce), by a process that owns the
    # account (review-evmwait M2). The dead process's lease, as if its 30 s had passed:
    crashed = iso.settlement(intent["intent_id"]).relay_address
    Redis.from_url(iso.redis_url).delete(evm_relay.LEASE_KEY.format(NETWORK, crashed))
    healthy = iso.relayer()
    try:
        counts = iso.reconcile_later()
        assert counts["resent"] == 1
        row = iso.wait_paid(intent["intent_id"])
    finally:
        stop_process(healthy)
    assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000
    assert row.tx_hash == iso.settlement(intent["intent_id"]).tx_hash
    assert len(iso.completed_events(intent["intent_id"])) == 1


def test_api_killed_while_waiting_ends_paid_once(iso, db_url, redis_server_url, devnet):
    intent = create_intent(iso.client, iso.shop, 3)
    payload = sign_authorization(devnet.buyer(2).key, requirement(intent, NETWORK))
    port = free_port()
    env = {**os.environ, "DATABASE_URL": db_url, "REDIS_URL": redis_server_url, "LOG_LEVEL": "WARNING",
           "CHAINS_FILE": devnet.info["chains_file"], "RELAYER_QUEUE": iso.queue, "PAY_WAIT_SECONDS": "60"}  # fmt: skip
    api = subprocess.Popen([PAYINTENT, "serve", "--port", str(port), "--workers", "1"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"{base}/healthz", timeout=1).ok:
                    break
            except requests.RequestException:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        outcome: dict[str, Any] = {}

        def call() -> None:
            body = {"intent_id": intent["intent_id"], "payment_signature": {
                "scheme": "exact", "network": NETWORK, "x402Version": 1, "payload": payload}}  # fmt: skip
            try:
                outcome["response"] = requests.post(f"{base}/api/v1/x402/pay", json=body, headers=iso.shop.headers,
                                                    timeout=90)  # fmt: skip
            except requests.RequestException as exc:
                outcome["error"] = exc

        waiter = threading.Thread(target=call)
        waiter.start()
        deadline = time.monotonic() + 20
        while iso.intent_row(intent["intent_id"]).settlement_id is None:  # the API claimed the intent
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(api.pid, signal.SIGKILL)  # the API dies while /pay waits for the relayer
        waiter.join(timeout=30)
        assert "error" in outcome  # the caller saw the connection drop
    finally:
        if api.poll() is None:
            os.killpg(api.pid, signal.SIGKILL)
        api.wait()
    relayer = iso.relayer()
    try:
        # The API may have died between its claim and enqueueing the relayer job: the worker's
        # reconciler (run here as it would run every 15 s) re-sends whatever was left open.
        if iso.intent_row(intent["intent_id"]).status != "paid":
            iso.reconcile_later()
        row = iso.wait_paid(intent["intent_id"])
    finally:
        stop_process(relayer)
    assert iso.devnet.balance(NETWORK, iso.payout) == 3_000_000
    assert row.buyer_address == devnet.buyer(2).address
    assert len(iso.completed_events(intent["intent_id"])) == 1
    response = iso.client.get(f"{INTENTS}/{intent['intent_id']}", headers=iso.shop.headers)
    assert response.get_json()["data"]["status"] == "paid"


def test_cancel_and_expiry_never_win_over_a_settlement_in_flight(iso):
    intent = create_intent(iso.client, iso.shop, 1)
    payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK))
    response = pay(iso.client, iso.shop, intent, NETWORK, payload)  # no relayer yet: it waits, then 504
    assert response.get_json()["error"]["code"] == "SETTLEMENT_PENDING"
    cancel = iso.client.delete(f"{INTENTS}/{intent['intent_id']}", headers=iso.shop.headers)
    assert cancel.status_code == 409 and cancel.get_json()["error"]["code"] == "PAYMENT_IN_PROGRESS"
    db.session.execute(
        update(Intent)
        .where(Intent.id == intent["intent_id"])
        .values(expires_at=datetime.now(UTC) - timedelta(minutes=1))
    )
    db.session.commit()
    assert expire_overdue() == 0
    read = iso.client.get(f"{INTENTS}/{intent['intent_id']}", headers=iso.shop.headers).get_json()["data"]
    assert read["status"] == "pending"
    second = sign_authorization(iso.devnet.buyer(1).key, requirement(intent, NETWORK))
    other = pay(iso.client, iso.shop, intent, NETWORK, second)
    assert other.status_code == 409 and other.get_json()["error"]["code"] == "PAYMENT_IN_PROGRESS"
    relayer = iso.relayer()
    try:
        iso.wait_paid(intent["intent_id"])
    finally:
        stop_process(relayer)
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000
    assert len(iso.completed_events(intent["intent_id"])) == 1


def test_relayer_pool_uses_several_relay_accounts_in_parallel(iso):
    from concurrent.futures import ThreadPoolExecutor

    intents = [create_intent(iso.client, iso.shop, 1) for _ in range(8)]
    payloads = [
        sign_authorization(iso.devnet.buyer(i % 3).key, requirement(it, NETWORK)) for i, it in enumerate(intents)
    ]
    env = {**os.environ, "DATABASE_URL": iso.db_url, "REDIS_URL": iso.redis_url, "LOG_LEVEL": "WARNING",
           "CHAINS_FILE": iso.devnet.info["chains_file"], "RELAYER_QUEUE": iso.queue,
           # One settlement at a time per process: with its threads, one process could take all 8 (one account).
           "RELAYER_THREADS": "1"}  # fmt: skip
    pool = subprocess.Popen([PAYINTENT, "relayer", "--processes", "4"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        redis = Redis.from_url(iso.redis_url)
        deadline = time.monotonic() + 120  # four processes starting at once on a loaded machine (xdist)
        while len(present_relayers(redis, relayer_queue(iso.queue, NETWORK))) < 4:  # all four take settlements
            assert time.monotonic() < deadline and pool.poll() is None
            time.sleep(0.1)

        def attempt(pair: tuple[dict[str, Any], dict[str, Any]]) -> int:
            with iso.app.test_client() as c:
                return pay(c, iso.shop, pair[0], NETWORK, pair[1]).status_code

        with ThreadPoolExecutor(max_workers=8) as workers:
            statuses = list(workers.map(attempt, zip(intents, payloads, strict=True)))
        for intent in intents:
            iso.wait_paid(intent["intent_id"])
    finally:
        pool.send_signal(signal.SIGTERM)
        pool.wait(timeout=30)
    assert all(s in (200, 504) for s in statuses), statuses
    db.session.expire_all()
    relays = {s.relay_address for s in db.session.scalars(select(Settlement).where(Settlement.status == "confirmed"))}
    assert len(relays) > 1
    assert iso.devnet.balance(NETWORK, iso.payout) == 8_000_000


def _token(devnet: Any, network: str) -> Any:
    artifact = json.loads((Path(__file__).resolve().parents[2] / "devnet" / "artifacts" / "TestUSDC.json").read_text())
    w3 = devnet.w3(network)
    return w3, w3.eth.contract(address=devnet.info["networks"][network]["usdc_address"], abi=artifact["abi"])


def _send_as(w3: Any, account: Any, call: Any) -> Any:
    w3.provider.make_request("anvil_setBalance", [account.address, hex(10**18)])
    tx = call.build_transaction({"from": account.address, "nonce": w3.eth.get_transaction_count(account.address),
                                 "chainId": w3.eth.chain_id})  # fmt: skip
    receipt = w3.eth.wait_for_transaction_receipt(
        w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction)
    )
    assert receipt["status"] == 1
    return receipt


def test_buyer_cancelling_the_authorization_releases_the_intent(iso):
    from eth_account import Account

    buyer = Account.create()
    w3, token = _token(iso.devnet, NETWORK)
    _send_as(w3, iso.devnet.buyer(0), token.functions.transfer(buyer.address, 5_000_000))
    intent = create_intent(iso.client, iso.shop, 1)
    payload = sign_authorization(buyer.key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, payload).get_json()["error"]["code"] == "SETTLEMENT_PENDING"
    signed = Account.sign_typed_data(
        buyer.key,
        {"name": "USDC", "version": "2", "chainId": w3.eth.chain_id, "verifyingContract": token.address},
        {"CancelAuthorization": [{"name": "authorizer", "type": "address"}, {"name": "nonce", "type": "bytes32"}]},
        {"authorizer": buyer.address, "nonce": bytes.fromhex(payload["nonce"][2:])},
    )
    cancel = token.get_function_by_signature("cancelAuthorization(address,bytes32,bytes)")
    _send_as(w3, buyer, cancel(buyer.address, bytes.fromhex(payload["nonce"][2:]), bytes(signed.signature)))
    relayer = iso.relayer()
    try:
        iso.wait_settlement(intent["intent_id"], "failed")
    finally:
        stop_process(relayer)
    assert iso.settlement(intent["intent_id"]).failure_code == "AUTHORIZATION_CANCELED"
    assert iso.intent_row(intent["intent_id"]).settlement_id is None  # payable again
    assert iso.devnet.balance(NETWORK, iso.payout) == 0


def test_a_released_authorization_that_executes_later_still_pays_the_intent(iso):
    """A revert (balance moved away) releases the intent; if the same authorization executes later
    (anyone can submit it), the reconciler's watch marks the intent paid: the database follows the chain."""
    from eth_account import Account

    buyer, elsewhere = Account.create(), Account.create()
    w3, token = _token(iso.devnet, NETWORK)
    _send_as(w3, iso.devnet.buyer(1), token.functions.transfer(buyer.address, 2_000_000))
    intent = create_intent(iso.client, iso.shop, 2)
    payload = sign_authorization(buyer.key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, payload).get_json()["error"]["code"] == "SETTLEMENT_PENDING"
    _send_as(w3, buyer, token.functions.transfer(elsewhere.address, 2_000_000))  # funds gone before relaying
    relayer = iso.relayer()
    try:
        iso.wait_settlement(intent["intent_id"], "failed")
    finally:
        stop_process(relayer)
    settlement = iso.settlement(intent["intent_id"])
    assert settlement.failure_code == "SETTLEMENT_FAILED" and "revert" in settlement.failure_reason
    assert iso.intent_row(intent["intent_id"]).settlement_id is None
    # The funds come back and a third party submits the buyer's public authorization itself.
    _send_as(w3, elsewhere, token.functions.transfer(buyer.address, 2_000_000))
    sig = bytes.fromhex(payload["signature"][2:])
    outsider = Account.create()
    _send_as(w3, outsider, token.functions.transferWithAuthorization(
        payload["from"], payload["to"], int(payload["value"]), 0, int(payload["validBefore"]),
        bytes.fromhex(payload["nonce"][2:]), sig[64], sig[:32], sig[32:64]))  # fmt: skip
    assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000
    assert iso.reconcile_later()["late"] == 1
    row = iso.intent_row(intent["intent_id"])
    assert row.status == "paid" and row.buyer_address == buyer.address
    assert len(iso.completed_events(intent["intent_id"])) == 1


def test_retry_of_a_paid_intent_is_already_paid_whatever_it_carries(iso):
    relayer = iso.relayer()
    try:
        intent = create_intent(iso.client, iso.shop, 1)
        iso.app.config["PAYINTENT_SETTINGS"] = iso.app.config["PAYINTENT_SETTINGS"].__class__(
            **{**iso.app.config["PAYINTENT_SETTINGS"].__dict__, "pay_wait_seconds": 30}
        )
        payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK))
        assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 200
    finally:
        stop_process(relayer)
    stale = {**payload, "validBefore": "1000"}  # expired, and a bad signature too
    for network, body in ((NETWORK, stale), ("eip155:1", payload)):
        response = pay(iso.client, iso.shop, intent, network, body)
        assert response.status_code == 409 and response.get_json()["error"]["code"] == "ALREADY_PAID"
    db.session.expire_all()
    assert not db.session.scalars(select(Event).where(Event.type == "payment.failed")).all()


def test_long_lived_authorizations_are_refused(iso):
    intent = create_intent(iso.client, iso.shop, 1)
    payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK), valid_for=7200)
    response = pay(iso.client, iso.shop, intent, NETWORK, payload)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "AUTHORIZATION_TOO_LONG"


def test_paying_yourself_is_refused(iso):
    buyer = iso.devnet.buyer(2)
    selfish = create_merchant(iso.app, f"self-{uuid.uuid4().hex[:6]}@example.com", {NETWORK: buyer.address})
    intent = create_intent(iso.client, selfish, 1)
    response = pay(iso.client, selfish, intent, NETWORK, sign_authorization(buyer.key, requirement(intent, NETWORK)))
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "PAYER_IS_RECIPIENT"


def test_one_relayer_per_chain_settles_only_its_network(iso):
    """RELAYER_NETWORKS: a Base Sepolia relayer settles Base Sepolia and leaves an Ethereum Sepolia
    settlement on that network's list, which the Ethereum Sepolia relayer then settles."""
    from backend.settlement import intake

    other = "eip155:11155111"
    base_only = iso.relayer(RELAYER_NETWORKS=NETWORK)
    try:
        first, second = create_intent(iso.client, iso.shop, 2), create_intent(iso.client, iso.shop, 3)
        response = pay(iso.client, iso.shop, first, NETWORK,
                       sign_authorization(iso.devnet.buyer(0).key, requirement(first, NETWORK)))  # fmt: skip
        assert response.status_code == 200, response.get_json()
        response = pay(iso.client, iso.shop, second, other,
                       sign_authorization(iso.devnet.buyer(0).key, requirement(second, other)))  # fmt: skip
        assert response.status_code == 504  # nobody settles that chain yet (PAY_WAIT_SECONDS is 3 here)
        assert intake.depth(Redis.from_url(iso.redis_url), iso.queue, other) == 1  # waits on that network's list
        assert iso.settlement(second["intent_id"]).status == "pending"  # the Base Sepolia relayer left it alone
        ethereum_only = iso.relayer(RELAYER_NETWORKS=other)
        try:
            assert iso.wait_paid(second["intent_id"]).status == "paid"
        finally:
            stop_process(ethereum_only)
        assert iso.devnet.balance(other, iso.payout) == 3_000_000
        assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000
    finally:
        stop_process(base_only)


def test_relayer_refuses_networks_it_cannot_settle(iso):
    """RELAYER_NETWORKS naming an unknown network, or one without keys, stops the relayer at start-up."""
    env = {**os.environ, "DATABASE_URL": iso.db_url, "REDIS_URL": iso.redis_url,
           "CHAINS_FILE": iso.devnet.info["chains_file"], "RELAYER_QUEUE": iso.queue}  # fmt: skip
    done = subprocess.run([PAYINTENT, "relayer"], env={**env, "RELAYER_NETWORKS": "eip155:1"},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert "RELAYER_NETWORKS names networks the chains file does not have: eip155:1" in done.stdout + done.stderr
    all_keys = json.loads(Path(iso.devnet.info["relay_keys_file"]).read_text())
    base_keys = json.dumps({NETWORK: all_keys[NETWORK]})  # this relayer holds Base Sepolia's keys only
    narrowed = {**env, "RELAY_KEYS": base_keys, "RELAYER_NETWORKS": "eip155:11155111"}
    done = subprocess.run([PAYINTENT, "relayer"], env=narrowed, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "no relay keys for eip155:11155111 (named in RELAYER_NETWORKS)" in done.stdout + done.stderr


def test_relayer_logs_follow_log_level(iso):
    """LOG_LEVEL sets what the relayer logs (it ran RQ's worker, whose loggers were always INFO until handed it;
    now it runs none)."""
    env = {**os.environ, "DATABASE_URL": iso.db_url, "REDIS_URL": iso.redis_url, "LOG_FORMAT": "text",
           "CHAINS_FILE": iso.devnet.info["chains_file"], "RELAYER_QUEUE": iso.queue}  # fmt: skip
    for level, logged in (("WARNING", False), ("INFO", True)):
        done = subprocess.run([PAYINTENT, "relayer", "--burst"], env={**env, "LOG_LEVEL": level},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert ("relayer: listening on" in done.stderr) is logged, (level, done.stderr)  # an INFO line
        assert "rq.worker" not in done.stderr
