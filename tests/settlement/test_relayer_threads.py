"""One relayer process settles many payments at once (RELAYER_THREADS), each exactly once.

The chain stops mining, so every transaction the relayer sends waits in the node's pool: with 8 threads one
process has 8 transactions there at once; with 1 thread it has one, and the next only once that one is mined.
A relayer stopped with settlements in flight exits within its grace period and leaves them open; a restart and
the reconciler finish each one, paid once. Real Anvil, real relayer processes, real database and Redis.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from backend import appstate
from backend.appstate import SETTINGS_KEY
from backend.queueing import STOP_DEADLINE_SECONDS
from devnet.anvil import rpc
from payintent.eip3009 import sign_authorization
from tests.settlement.conftest import stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_payer_code import funded_buyer, relay_addresses
from tests.settlement.test_recovery import NETWORK, Isolated, _token, iso

__all__ = ["iso"]

pytestmark = [pytest.mark.db, pytest.mark.redis]


@pytest.fixture
def quick(iso: Isolated) -> Isolated:
    """``iso`` whose /pay waits only briefly for the relayer: the payments are claimed one after the other."""
    iso.app.config[SETTINGS_KEY] = dataclasses.replace(appstate.settings(iso.app), pay_wait_seconds=0.2)
    return iso


@pytest.fixture
def freeze(devnet: Any) -> Iterator[Callable[[], str]]:
    """``freeze()``: the chain mines nothing until the test says so (sent transactions wait in the node's pool);
    it mines again after the test."""
    url = devnet.info["networks"][NETWORK]["rpc_url"]

    def run() -> str:
        rpc(url, "evm_setAutomine", [False])
        return str(url)

    yield run
    rpc(url, "evm_setAutomine", [True])


# A relayer's start may fill nonces the chain lacks below its Redis hint with cancels (0 wei to itself, never a
# payment): test_finality reverts the chain to a snapshot, undoing transactions the hint still names, so the next
# relayer of this session cancels those nonces. Counting every relay transaction once made this test see 9 for 8
# payments (a cancel, not a second transfer). The counts below are of payments; every other one must be a cancel.


def _is_cancel(tx: Any) -> bool:
    return str(tx["to"]).lower() == str(tx["from"]).lower() and int(str(tx["value"]), 0) == 0


def _payments(txs: list[Any], devnet: Any) -> int:
    """How many of ``txs`` (our relay accounts') are payments: to the token; anything else must be a cancel."""
    token = str(devnet.info["networks"][NETWORK]["usdc_address"]).lower()
    assert all(_is_cancel(tx) or str(tx["to"]).lower() == token for tx in txs), txs
    return sum(not _is_cancel(tx) for tx in txs)


def _in_pool(w3: Any, devnet: Any) -> int:
    """Payments of our relay accounts sent but not mined."""
    relays = {a.lower() for a in relay_addresses(devnet)}
    content = w3.provider.make_request("txpool_content", [])["result"]
    txs = [tx for section in ("pending", "queued") for sender, held in content.get(section, {}).items()
           if sender.lower() in relays for tx in held.values()]  # fmt: skip
    return _payments(txs, devnet)


def _mined_payments(w3: Any, devnet: Any, since: int) -> int:
    """Payments of our relay accounts mined after block ``since``."""
    relays = {a.lower() for a in relay_addresses(devnet)}
    blocks = range(since + 1, w3.eth.block_number + 1)
    txs = [tx for n in blocks for tx in w3.eth.get_block(n, full_transactions=True)["transactions"]]
    return _payments([tx for tx in txs if tx["from"].lower() in relays], devnet)


def _claim(iso: Isolated, count: int, amount: int) -> list[tuple[dict[str, Any], Any]]:
    """``count`` payments of ``amount`` atomic units claimed by /pay (each from its own buyer), none sent yet."""
    w3, token = _token(iso.devnet, NETWORK)
    buyers = [funded_buyer(w3, token, iso.devnet, amount) for _ in range(count)]  # mined before the freeze
    return [(create_intent(iso.client, iso.shop, amount / 1_000_000), buyer) for buyer in buyers]


def _pay_all(iso: Isolated, claims: list[tuple[dict[str, Any], Any]]) -> None:
    for intent, buyer in claims:
        response = pay(
            iso.client, iso.shop, intent, NETWORK, sign_authorization(buyer.key, requirement(intent, NETWORK))
        )
        assert response.status_code == 504, response.get_json()  # claimed and queued; nothing is mined


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _assert_paid_once(iso: Isolated, claims: list[tuple[dict[str, Any], Any]], amount: int) -> None:
    for intent, buyer in claims:
        assert iso.intent_row(intent["intent_id"]).status == "paid"
        assert len(iso.completed_events(intent["intent_id"])) == 1
        assert iso.devnet.balance(NETWORK, buyer.address) == 0
    assert iso.devnet.balance(NETWORK, iso.payout) == amount * len(claims)  # each moved once


@pytest.mark.parametrize(("threads", "count"), [(8, 8), (1, 3)], ids=["8-threads", "1-thread"])
def test_one_relayer_process_has_as_many_transactions_in_flight_as_it_has_threads(
    quick: Isolated, freeze: Callable[[], str], threads: int, count: int
) -> None:
    iso, amount = quick, 1_000_000
    w3, _ = _token(iso.devnet, NETWORK)
    claims = _claim(iso, count, amount)
    frozen = freeze()
    since = w3.eth.block_number
    _pay_all(iso, claims)
    relayer = iso.relayer(RELAYER_THREADS=str(threads))
    try:
        expected = min(threads, count)
        _wait(lambda: _in_pool(w3, iso.devnet) >= expected, 90, f"{expected} transactions in the pool")
        time.sleep(3)  # time for more to be sent, were the setting not honoured
        assert _in_pool(w3, iso.devnet) == expected  # 8 threads: all 8 at once; 1 thread: one at a time
        while any(iso.intent_row(i["intent_id"]).status != "paid" for i, _ in claims):
            assert _in_pool(w3, iso.devnet) <= threads
            rpc(frozen, "evm_mine")  # what is in the pool is mined; the threads see their receipts
            _wait(lambda: _in_pool(w3, iso.devnet) > 0 or all(
                iso.intent_row(i["intent_id"]).status == "paid" for i, _ in claims), 90, "the next send")  # fmt: skip
    finally:
        stop_process(relayer)
    _assert_paid_once(iso, claims, amount)
    assert _mined_payments(w3, iso.devnet, since) == count  # one transaction per payment
    counts = iso.reconcile_later()
    assert counts["finished"] == 0 and counts["resent"] == 0  # nothing left open


def test_relayer_stopped_with_settlements_in_flight_exits_in_its_grace_and_each_ends_paid_once(
    quick: Isolated, freeze: Callable[[], str]
) -> None:
    iso, amount, count = quick, 2_000_000, 4
    w3, _ = _token(iso.devnet, NETWORK)
    claims = _claim(iso, count, amount)
    frozen = freeze()
    since = w3.eth.block_number
    _pay_all(iso, claims)
    relayer = iso.relayer(RELAYER_THREADS="8")
    try:
        _wait(lambda: _in_pool(w3, iso.devnet) == count, 90, "every payment's transaction in the pool")
        relayer.send_signal(signal.SIGTERM)  # each thread waits for its receipt (up to 120 s)
        started = time.monotonic()
        assert relayer.wait(timeout=60) == 0
        assert time.monotonic() - started < STOP_DEADLINE_SECONDS + 15  # the grace, not the receipts' 120 s
    finally:
        stop_process(relayer)
    for intent, _ in claims:
        assert iso.settlement(intent["intent_id"]).status == "submitted"  # left open, as a crash would
    assert iso.devnet.balance(NETWORK, iso.payout) == 0
    rpc(frozen, "evm_mine")
    restarted = iso.relayer()
    try:
        counts = iso.reconcile_later()
        assert counts["finished"] + counts["resent"] == count
        for intent, _ in claims:
            iso.wait_paid(intent["intent_id"], timeout=90)
    finally:
        stop_process(restarted)
    _assert_paid_once(iso, claims, amount)
    assert _mined_payments(w3, iso.devnet, since) == count  # nothing sent twice
    assert iso.reconcile_later()["finished"] == 0
