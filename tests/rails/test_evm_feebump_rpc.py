"""The fee bump against an RPC that lags or refuses for a while (second review, F1 and F2): a job whose watcher's
receipts lag behind the chain still finds its own mined transaction (never "taken by another", which left the gas
uncharged and the payment to the reconciler), and one rate-limit answer to a replacement does not end the bumps."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import requests

from backend.rails.evm import blocks, pipeline, sender
from backend.rails.evm.rpcbatch import Answer
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
    with caplog.at_level(logging.WARNING, logger=sender.__name__):
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
    real_broadcast = sender.broadcast
    refused: list[bytes] = []

    def once_429(chain: Any, owned: Any, raw: bytes) -> None:
        if len(stuck.records) >= 2 and not refused:
            refused.append(raw)
            response = requests.Response()
            response.status_code = 429
            raise requests.HTTPError("429 Too Many Requests", response=response)
        real_broadcast(chain, owned, raw)

    monkeypatch.setattr(sender, "broadcast", once_429)
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
