"""A relayer stopped mid-settlement stops within seconds at a safe point, and the payment still ends paid once.

It used to wait for the receipt of the transaction in hand (up to two minutes) before honouring SIGTERM.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from backend.queueing import STOP_GRACE_SECONDS
from devnet.anvil import rpc
from payintent.eip3009 import sign_authorization
from tests.settlement.conftest import stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, iso

__all__ = ["iso"]


@pytest.fixture
def no_mining(devnet: Any) -> Iterator[str]:
    """The chain stops mining: a transaction sent now waits in the pool until the test mines a block."""
    url = devnet.info["networks"][NETWORK]["rpc_url"]
    rpc(url, "evm_setAutomine", [False])
    try:
        yield url
    finally:
        rpc(url, "evm_setAutomine", [True])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_relayer_stopped_while_waiting_for_a_receipt_stops_at_once_and_the_payment_ends_paid_once(
    iso: Any,
    no_mining: str,
    sig: signal.Signals,
) -> None:
    intent = create_intent(iso.client, iso.shop, 3)
    payload = sign_authorization(iso.devnet.buyer(2).key, requirement(intent, NETWORK))
    relayer = iso.relayer()
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504  # sent, not mined
        settlement = iso.wait_settlement(intent["intent_id"], "submitted")
        assert settlement.tx_hash
        relayer.send_signal(sig)  # the relayer is waiting for the receipt (RECEIPT_TIMEOUT_SECONDS: 120 s)
        started = time.monotonic()
        assert relayer.wait(timeout=60) == 0
        # Seconds, not the receipt's 120 s; the margin covers a loaded machine (the suite runs on 4 xdist workers).
        assert time.monotonic() - started < STOP_GRACE_SECONDS + 15
    finally:
        stop_process(relayer)
    assert iso.devnet.balance(NETWORK, iso.payout) == 0  # nothing mined yet
    rpc(no_mining, "evm_mine")  # the transaction it sent is mined after all
    assert iso.devnet.balance(NETWORK, iso.payout) == 3_000_000
    assert iso.reconcile_later()["finished"] == 1  # the reconciler finishes what the relayer left
    row = iso.intent_row(intent["intent_id"])
    assert row.status == "paid" and row.tx_hash == settlement.tx_hash
    assert len(iso.completed_events(intent["intent_id"])) == 1
    assert iso.reconcile_later()["finished"] == 0
    assert iso.devnet.balance(NETWORK, iso.payout) == 3_000_000  # moved once


def test_a_second_stop_signal_ends_the_grace_counted_from_the_first_signal(iso: Any, no_mining: str) -> None:
    """The grace counts from the first signal, not from the loop's end, and a second signal a second or more
    after the first ends it, even one that came while the loop was still winding down."""
    intent = create_intent(iso.client, iso.shop, 3)
    payload = sign_authorization(iso.devnet.buyer(2).key, requirement(intent, NETWORK))
    relayer = iso.relayer()
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504  # sent, not mined
        assert iso.wait_settlement(intent["intent_id"], "submitted").tx_hash
        relayer.send_signal(signal.SIGTERM)  # one settlement in flight: the grace (8 s) starts
        started = time.monotonic()
        time.sleep(1.5)  # the loop has ended (within about 1 s) or is ending: counted from the loop's end, too soon
        relayer.send_signal(signal.SIGTERM)  # "stop now"
        assert relayer.wait(timeout=60) == 0
        assert time.monotonic() - started < 5  # not the 8 s grace
    finally:
        stop_process(relayer)
    rpc(no_mining, "evm_mine")
    assert iso.reconcile_later()["finished"] == 1  # the reconciler finishes what the relayer left
    assert iso.devnet.balance(NETWORK, iso.payout) == 3_000_000  # moved once
    assert iso.intent_row(intent["intent_id"]).status == "paid"
