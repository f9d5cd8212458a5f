"""The block watcher's crash point (``after-watch-block``, the `watcher` drill): the hook ``pipeline.AFTER_WAKE`` runs
once a round has handed a block's receipts to the settlement threads waiting on them, with how many it woke; the
relayer's rule (``relayer.faults.after_watch_block``) kills the process when that is two or more."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest

from backend.rails.base import TxState
from backend.rails.evm import pipeline
from backend.rails.evm.rail import EVM_RAIL
from relayer import faults
from tests.rails.test_evm_pipeline import Chain, _claim_of, _until, node  # noqa: F401
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)


def test_the_hook_runs_after_one_round_woke_the_waiters_of_a_block(node: Chain, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    account = node.relay_account()
    watcher = pipeline.shared_watcher(node.chain)
    node.rpc("evm_setAutomine", False)
    base = node.w3.eth.get_transaction_count(account.address)
    txs = [{"to": account.address, "value": 0, "gas": 21_000, "gasPrice": 2 * 10**9, "nonce": base + i,
            "chainId": node.network.chain_id} for i in range(2)]  # fmt: skip
    raws = [account.sign_transaction(tx) for tx in txs]
    hashes = ["0x" + bytes(raw.hash).hex() for raw in raws]
    results: dict[str, Any] = {}
    calls: list[tuple[int, list[bool]]] = []
    expected: list[Any] = []  # the watcher's entries of the two hashes, taken while their jobs wait

    def hook(woken: int) -> None:  # each waiter's receipt already handed over when it runs
        calls.append((woken, [entry.status is not None and entry.event.is_set() for entry in expected]))

    monkeypatch.setattr(pipeline, "AFTER_WAKE", hook)

    def job(i: int) -> None:
        watcher.expect(hashes[i], bytes(raws[i].raw_transaction))
        node.w3.eth.send_raw_transaction(raws[i].raw_transaction)
        results[hashes[i]] = EVM_RAIL.wait_landed(node.network, _claim_of(hashes[i]), 60)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    _until(lambda: len(watcher.blocks.tracked()) == 2 and all(watcher._expected[h].waiters for h in hashes))
    expected.extend(watcher._expected[h] for h in hashes)
    assert calls == []  # nothing mined, nobody woken: never called
    node.rpc("evm_mine")
    for thread in threads:
        thread.join(timeout=60)
    assert {s.state for s in results.values()} == {TxState.SUCCEEDED} and len(results) == 2
    assert [woken for woken, _ in calls] == [2]  # one round, both waiters of the block
    assert calls[0][1] == [True, True]


@pytest.mark.parametrize(("woken", "exit_code"), [(1, 0), (2, faults.CRASH_EXIT_CODE)])
def test_the_relayer_crashes_when_a_round_woke_two_or_more(woken: int, exit_code: int):
    code = f"from relayer.faults import after_watch_block; after_watch_block({woken})"
    env = dict(os.environ, PAYINTENT_FAULT=faults.WATCH_POINT)
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == exit_code
