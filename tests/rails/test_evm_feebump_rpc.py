"""The fee bump against an RPC that lags or refuses for a while (second review, F1 and F2): a job whose watcher's
receipts lag behind the chain still finds its own mined transaction (never "taken by another", which left the gas
uncharged and the payment to the reconciler), and one rate-limit answer to a replacement does not end the bumps;
neither the bump's record of a replacement nor its put-back after a refusal moves a row another attempt recorded
since (each writes only while the row names what it replaces)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import requests
from eth_account import Account
from web3.exceptions import Web3RPCError

from backend.rails.evm import blocks, feebump, pipeline
from backend.rails.evm.rpcbatch import Answer
from backend.rails.evm.watch import rpc_counter
from tests.rails.test_evm_feebump import NETWORK, Stuck, _relay_spends, iso, stuck, until  # noqa: F401
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)


def test_receipts_lagging_behind_the_chain_do_not_make_our_mined_transaction_look_taken(
    stuck: Stuck,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    intent_id, settlement_id = stuck.open_settlement(2)
    stuck.rpc("evm_setAutomine", False)
    thread = stuck.settle_in_thread(settlement_id)
    until(lambda: stuck.records)
    first = stuck.records[0][0]
    old = stuck.pending(first)
    until(lambda: pipeline._watchers[NETWORK].raw_of(first) is not None)
    old_raw = pipeline._watchers[NETWORK].raw_of(first)
    assert old_raw is not None
    stuck.mine_high_until(old["maxFeePerGas"] * 3 // 2, lambda: len(stuck.records) > 1)
    second = stuck.records[1][0]
    stuck.pending(second)
    real_read = blocks.BlockWatcher._read
    lag_until = time.monotonic() + 30.0  # the watcher's node answers "no receipt" for the first for 30 s

    def lagging(self: Any, poll_head: int, landed: Any) -> Any:
        head, receipts, canon = real_read(self, poll_head, landed)
        if time.monotonic() < lag_until:
            receipts = {h: (Answer(None) if h == first.lower() else a) for h, a in receipts.items()}
        return head, receipts, canon

    monkeypatch.setattr(blocks.BlockWatcher, "_read", lagging)
    stuck.rpc("anvil_dropTransaction", second)  # the first is mined after all
    stuck.mine(1)
    stuck.w3.eth.send_raw_transaction(old_raw)
    stuck.mine(1)
    assert stuck.w3.eth.get_transaction_receipt(first)["status"] == 1
    with caplog.at_level(logging.WARNING, logger=feebump.__name__):
        for _ in range(40):
            if not thread.is_alive():
                break
            stuck.mine(1)
            time.sleep(0.3)
        thread.join(timeout=30)
    assert time.monotonic() < lag_until, "the watcher lagged all along"
    assert "taken by a transaction other than" not in caplog.text
    assert stuck.outcomes == ["confirmed"]
    row = stuck.iso.settlement(intent_id)
    assert row.status == "confirmed" and row.tx_hash.lower() == first.lower()
    assert [reference for reference, _ in _relay_spends(stuck)] == [first.lower()]  # its gas charged, once


def test_a_rate_limit_answer_to_a_replacement_does_not_end_the_bumps(
    stuck: Stuck,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_broadcast = feebump.broadcast
    refused: list[bytes] = []

    def once_429(chain: Any, owned: Any, raw: bytes) -> None:
        if len(stuck.records) >= 2 and not refused:
            refused.append(raw)
            response = requests.Response()
            response.status_code = 429
            raise requests.HTTPError("429 Too Many Requests", response=response)
        real_broadcast(chain, owned, raw)

    monkeypatch.setattr(feebump, "broadcast", once_429)
    intent_id, settlement_id = stuck.open_settlement(0)
    stuck.rpc("evm_setAutomine", False)
    thread = stuck.settle_in_thread(settlement_id)
    until(lambda: stuck.records)
    first = stuck.records[0][0]
    high = stuck.pending(first)["maxFeePerGas"] * 3 // 2
    for _ in range(120):
        if not thread.is_alive():
            break
        stuck.mine(high)
        time.sleep(0.25)
    thread.join(timeout=30)
    assert refused, "the replacement was never refused"
    recorded = [tx_hash.lower() for tx_hash, _, _ in stuck.records]
    # The refused one recorded, the row put back on the first, then a replacement that went out and was mined.
    assert stuck.outcomes == ["confirmed"]
    row = stuck.iso.settlement(intent_id)
    assert row.tx_hash.lower() not in (first.lower(),) and row.tx_hash.lower() in recorded
    assert stuck.w3.eth.get_transaction_receipt(row.tx_hash)["status"] == 1


def test_the_put_back_never_moves_a_row_another_attempt_recorded_at_another_nonce(
    stuck: Stuck,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review (issue 16): after a lock loss another attempt may record the settlement at another (relay account,
    nonce) while this job broadcasts a replacement. The bump's put-back (its replacement refused) writes only while
    the row still names that replacement: the other attempt's record stands (the record made before the bump's own:
    the test below). Each bump round's look is one round trip. The first transaction is then mined: the row names
    it with its own (account, nonce), paid once, on chain."""
    real_broadcast = feebump.broadcast
    other_address, other_nonce, other_hash = Account.create().address, 5, "0x" + "ab" * 32
    refused: list[bytes] = []
    settlement: list[str] = []

    def moved_then_refused(chain: Any, owned: Any, raw: bytes) -> None:
        if len(stuck.records) >= 2 and not refused:
            refused.append(raw)  # the replacement, recorded; meanwhile another attempt records its own transaction
            stuck.real_mark_submitted(settlement[0], other_hash, other_address, relay_nonce=other_nonce)
            raise Web3RPCError("insufficient funds for gas * price + value")  # a sure refusal: no more bumps
        real_broadcast(chain, owned, raw)

    looks: list[tuple[int, int]] = []
    real_look = feebump._look

    def counted_look(chain: Any, *args: Any) -> Any:
        before = rpc_counter(chain).snapshot()
        try:
            return real_look(chain, *args)
        finally:
            after = rpc_counter(chain).snapshot()
            looks.append((after[0] - before[0], after[1] - before[1]))

    monkeypatch.setattr(feebump, "broadcast", moved_then_refused)
    monkeypatch.setattr(feebump, "_look", counted_look)
    payout_before = stuck.iso.devnet.balance(NETWORK, stuck.iso.payout)
    intent_id, settlement_id = stuck.open_settlement(1)
    settlement.append(settlement_id)
    stuck.rpc("evm_setAutomine", False)
    thread = stuck.settle_in_thread(settlement_id)
    until(lambda: stuck.records)
    first, address, nonce = stuck.records[0]
    until(lambda: pipeline._watchers[NETWORK].raw_of(first) is not None)
    old_raw = pipeline._watchers[NETWORK].raw_of(first)
    assert old_raw is not None
    stuck.mine_high_until(stuck.pending(first)["maxFeePerGas"] * 3 // 2, lambda: len(stuck.records) >= 3)
    assert refused and stuck.records[2] == (first, address, nonce)  # the put-back was asked for...
    row = stuck.iso.settlement(intent_id)
    assert (row.tx_hash, row.relay_address, row.relay_nonce) == (other_hash, other_address, other_nonce)  # ...moot
    assert looks and all(trips == 1 for _, trips in looks) and (2, 1) in looks  # the count and the block: one trip
    _first_mined_and_paid_once(stuck, thread, old_raw, (first, address, nonce), intent_id, payout_before)


def test_a_record_another_attempt_made_before_the_bump_recorded_stands_and_nothing_is_broadcast(
    stuck: Stuck,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Second review of issue 16 (F1): after this job's look and before its record of the replacement, another
    attempt (this job's lock lost) records the settlement at another (relay account, nonce). The bump's record is
    conditional on the row still naming the transaction in flight at the job's (account, nonce): it writes nothing,
    the replacement is never broadcast, and the job bumps no more. The first is then mined: the row names it with its
    own (account, nonce) (F2), paid once, on chain."""
    other_address, other_nonce, other_hash = Account.create().address, 5, "0x" + "cd" * 32
    settlement: list[str] = []
    moved: list[bool] = []
    broadcast_raws: list[bytes] = []
    real_sign, real_broadcast = feebump.sign_transfer, feebump.broadcast

    def sign_after_the_move(*args: Any) -> Any:
        if not moved:  # the bump's signing: after its look, before its record
            moved.append(True)
            stuck.real_mark_submitted(settlement[0], other_hash, other_address, relay_nonce=other_nonce)
        return real_sign(*args)

    def counted_broadcast(chain: Any, owned: Any, raw: bytes) -> None:
        broadcast_raws.append(raw)
        real_broadcast(chain, owned, raw)

    monkeypatch.setattr(feebump, "sign_transfer", sign_after_the_move)
    monkeypatch.setattr(feebump, "broadcast", counted_broadcast)
    payout_before = stuck.iso.devnet.balance(NETWORK, stuck.iso.payout)
    intent_id, settlement_id = stuck.open_settlement(1)
    settlement.append(settlement_id)
    stuck.rpc("evm_setAutomine", False)
    thread = stuck.settle_in_thread(settlement_id)
    until(lambda: stuck.records)
    first, address, nonce = stuck.records[0]
    until(lambda: pipeline._watchers[NETWORK].raw_of(first) is not None)
    old_raw = pipeline._watchers[NETWORK].raw_of(first)
    assert old_raw is not None
    high = stuck.pending(first)["maxFeePerGas"] * 3 // 2
    stuck.mine_high_until(high, lambda: len(stuck.records) >= 2)
    for _ in range(3 * feebump.DEFAULT_REPLACE_AFTER + 2):  # more rounds: never bumped again
        stuck.mine(high)
        time.sleep(0.25)
    second = stuck.records[1][0]
    assert len(stuck.records) == 2 and stuck.records[1][1:] == (address, nonce)  # asked for, once
    row = stuck.iso.settlement(intent_id)
    assert (row.tx_hash, row.relay_address, row.relay_nonce) == (other_hash, other_address, other_nonce)
    assert pipeline._watchers[NETWORK].raw_of(second) is None  # never handed to the watcher...
    with pytest.raises(Exception, match="not found"):
        stuck.w3.eth.get_transaction(second)  # ...nor sent
    assert not broadcast_raws  # the bump broadcast nothing
    _first_mined_and_paid_once(stuck, thread, old_raw, (first, address, nonce), intent_id, payout_before)


def _first_mined_and_paid_once(
    stuck: Stuck,  # noqa: F811
    thread: threading.Thread,
    old_raw: bytes,
    sent: tuple[str, str, int],
    intent_id: str,
    payout_before: int,
) -> None:
    """The fees fall and the first transaction (``sent``: hash, relay account, nonce) is mined (sent again if the
    node dropped it under the high base fee): the job ends confirmed, the row names the first with its own account
    and nonce, the intent is paid once, the money moved once and its gas charged once."""
    first, address, nonce = sent
    stuck.mine(1)
    try:
        stuck.w3.eth.send_raw_transaction(old_raw)
    except Exception as exc:
        assert "already" in str(exc).lower() or "known" in str(exc).lower(), exc
    for _ in range(40):
        if not thread.is_alive():
            break
        stuck.mine(1)
        time.sleep(0.3)
    thread.join(timeout=30)
    assert stuck.outcomes == ["confirmed"]
    assert stuck.w3.eth.get_transaction_receipt(first)["status"] == 1
    row = stuck.iso.settlement(intent_id)
    assert (row.status, row.tx_hash.lower(), row.relay_address.lower(), row.relay_nonce) == (
        "confirmed", first.lower(), address.lower(), nonce)  # fmt: skip
    assert stuck.iso.intent_row(intent_id).status == "paid" and len(stuck.iso.completed_events(intent_id)) == 1
    assert stuck.iso.devnet.balance(NETWORK, stuck.iso.payout) - payout_before == 1_000_000  # moved once
    assert [reference for reference, _ in _relay_spends(stuck)] == [first.lower()]  # its gas charged, once
