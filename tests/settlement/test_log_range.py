"""Issue 14 review, Medium: real RPC providers refuse eth_getLogs over wide block ranges.

The reconciler searched the token's logs over the whole range since the intent was claimed, in one
call: behind a provider that caps the range (1,000 to 10,000 blocks is common) that call failed on
every pass, and a payment that executed on chain was never recorded as paid. Now our own transaction
is read by its receipt first, and the logs are searched in windows that halve when the RPC refuses one.

Real Anvil chain and token, real database and Redis. Anvil cannot be told to limit eth_getLogs, so the
remote provider's behaviour is simulated on the transport of the reconciler's web3 provider: an
eth_getLogs over more than LIMIT blocks is answered with the JSON-RPC error such providers send.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.chains.evm import EvmChain, evm_chain
from payintent.eip3009 import sign_authorization
from relayer.faults import CRASH_EXIT_CODE
from tests.settlement.conftest import stop_process
from tests.settlement.test_duplicate import _execute
from tests.settlement.test_finality import ChainControl, chain  # noqa: F401  (fixture)
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import _token, iso  # noqa: F401  (fixture)

NETWORK = "eip155:84532"
LIMIT = 10  # blocks per eth_getLogs the simulated provider answers


class RangeLimitedRpc:
    """The remote RPC's range limit, on the wire: eth_getLogs over more than ``limit`` blocks is refused."""

    def __init__(self, client: EvmChain, limit: int | None) -> None:
        self.client, self.limit = client, limit
        self.spans: list[int] = []  # every eth_getLogs asked, by its width in blocks
        self.refused = 0
        self._send = client.w3.provider._make_request  # type: ignore[attr-defined]

    def __call__(self, method: str, request_data: bytes) -> bytes:
        if method == "eth_getLogs":
            request = json.loads(request_data)
            query = request["params"][0]
            head = int(json.loads(self._send("eth_blockNumber", _request("eth_blockNumber")))["result"], 16)
            span = _height(query["toBlock"], head) - _height(query["fromBlock"], head) + 1
            self.spans.append(span)
            if self.limit is None or span > self.limit:
                self.refused += 1
                message = f"block range is too wide: ranges over {self.limit} blocks are not supported"
                error = {"jsonrpc": "2.0", "id": request["id"], "error": {"code": -32600, "message": message}}
                return json.dumps(error).encode()
        return self._send(method, request_data)


def _request(method: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 0, "method": method, "params": []}).encode()


def _height(block: str, head: int) -> int:
    return head if block in ("latest", "pending", "safe", "finalized") else int(block, 16)


@pytest.fixture
def limited(iso: Any, monkeypatch: pytest.MonkeyPatch) -> Any:  # noqa: F811
    def install(limit: int | None) -> RangeLimitedRpc:
        reconciler_chain = evm_chain(iso.devnet.chains.get(NETWORK))  # the client the reconciler uses
        rpc = RangeLimitedRpc(reconciler_chain, limit)
        monkeypatch.setattr(reconciler_chain.w3.provider, "_make_request", rpc)
        monkeypatch.setattr(reconciler_chain, "log_range_limit", None, raising=False)  # nothing learned yet
        return rpc

    return install


def _paid_by_outsider(iso: Any, chain: ChainControl, amount: int) -> tuple[str, str, dict[str, str]]:  # noqa: F811
    """A claimed intent whose authorization an outsider executed, LIMIT * 4 blocks after the claim, with more
    blocks on top: the database knows no transaction, only the chain can tell it is paid."""
    intent = create_intent(iso.client, iso.shop, amount)
    payload = sign_authorization(iso.devnet.buyer(2).key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504  # no relayer on this queue
    chain.mine(LIMIT * 4)
    w3, token = _token(iso.devnet, NETWORK)
    executed = _execute(w3, token, payload)  # anyone may submit a signed authorization: an outsider does
    chain.mine(LIMIT * 3)
    settlement = iso.settlement(intent["intent_id"])
    assert settlement.tx_hash is None and chain.w3.eth.block_number - settlement.start_block > LIMIT * 7
    return intent["intent_id"], executed, payload


def test_a_payment_found_only_in_the_logs_is_recorded_behind_a_range_limited_rpc(iso, chain, limited):  # noqa: F811
    intent_id, executed, _ = _paid_by_outsider(iso, chain, 2)
    rpc = limited(LIMIT)

    counts = iso.reconcile_later()
    assert counts["errors"] == 0 and counts["finished"] == 1, counts
    row = iso.intent_row(intent_id)
    assert row.status == "paid" and row.tx_hash == executed
    assert row.buyer_address == iso.devnet.buyer(2).address
    assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000  # on chain: the merchant was paid, once
    assert rpc.refused >= 1 and max(s for s in rpc.spans if s <= LIMIT) <= LIMIT  # it walked in windows
    assert evm_chain(iso.devnet.chains.get(NETWORK)).log_range_limit <= LIMIT  # and remembers the width


def test_our_own_transaction_is_found_by_its_receipt_without_any_log_search(iso, chain, limited):  # noqa: F811
    intent = create_intent(iso.client, iso.shop, 3)
    intent_id = intent["intent_id"]
    payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK))
    crashing = iso.relayer(fault="before-finish")  # sends, sees it mined, dies before recording it
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504
        assert crashing.wait(timeout=60) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    settlement = iso.settlement(intent_id)
    assert settlement.status == "submitted" and settlement.tx_hash
    chain.mine(LIMIT * 5)
    rpc = limited(None)  # a provider that refuses every eth_getLogs

    counts = iso.reconcile_later()
    assert counts["errors"] == 0 and counts["finished"] == 1, counts
    row = iso.intent_row(intent_id)
    assert row.status == "paid" and row.tx_hash == settlement.tx_hash
    assert iso.devnet.balance(NETWORK, iso.payout) == 3_000_000
    assert rpc.spans == []  # the receipt of the known transaction was enough


def test_an_rpc_that_refuses_every_log_search_is_never_taken_for_not_found(iso, chain, limited):  # noqa: F811
    intent_id, _, payload = _paid_by_outsider(iso, chain, 1)
    chain.mine(timestamp=int(payload["validBefore"]) + 600)  # long past its validity
    rpc = limited(None)

    counts = iso.reconcile_later(900)
    assert counts["errors"] == 1 and counts["finished"] == 0, counts
    assert rpc.spans[-1] == 1  # halved down to one block, refused even then: an error, not "no log"
    row = iso.intent_row(intent_id)
    assert row.status == "pending" and row.settlement_id is not None  # paid on chain: never released
    assert iso.settlement(intent_id).status == "pending"
