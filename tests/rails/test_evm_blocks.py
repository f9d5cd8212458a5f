"""The EVM rail's block watcher (``backend.rails.evm.blocks``) and the batched ``watch``, on a real Anvil chain.

Mining is paused (``evm_setAutomine false``) and blocks are mined by hand; reorgs are made with
``evm_snapshot``/``evm_revert`` and ``anvil_reorg``. Transactions come from a fresh account funded with
``anvil_setBalance`` (no nonce shared with other tests); what a receipt cost is checked against the sender's
balance on chain. The chain is put back as it was after each test (snapshot), so the session's other tests see no
change. A node that refuses batches, or fails one element of a batch, is a small HTTP proxy in front of Anvil; node
misbehaviour Anvil cannot produce is in test_evm_rpcbatch.py (a scripted fake node).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from eth_account import Account
from eth_account.signers.local import LocalAccount
from web3 import Web3

from backend.chains.evm import EvmChain
from backend.rails.base import Claim, TxState, TxStatus
from backend.rails.evm import watch as watch_module
from backend.rails.evm.blocks import BlockWatcher, Final, Mined, Missing, Reorged
from backend.rails.evm.rpcbatch import RpcCounter
from harness.proxy import RpcProxy
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)

NETWORK = "eip155:84532"
GAS_PRICE = 2 * 10**9
SINK = "0x000000000000000000000000000000000000dEaD"


class Node:
    """The devnet chain, mined by hand, and a funded account of this test's own."""

    def __init__(self, w3: Web3, chains: Any) -> None:
        self.w3 = w3
        self.network = chains.get(NETWORK)
        self.account: LocalAccount = Account.create()
        self.nonce = 0
        self.rpc("anvil_setBalance", self.account.address, hex(10**21))

    def rpc(self, method: str, *params: Any) -> Any:
        response = self.w3.provider.make_request(method, list(params))  # type: ignore[arg-type]
        assert "error" not in response, (method, response)
        return response["result"]

    def chain(self, confirmations: int = 1, rpc_url: str | None = None) -> EvmChain:
        network = dataclasses.replace(
            self.network, confirmations=confirmations, rpc_url=rpc_url or self.network.rpc_url
        )
        return EvmChain(network)

    def mine(self, blocks: int = 1) -> int:
        for _ in range(blocks):
            self.rpc("evm_mine")
        return int(self.w3.eth.block_number)

    def sign(self, to: str = SINK, value: int = 1, data: str = "0x", gas: int = 21_000) -> bytes:
        tx = {"to": Web3.to_checksum_address(to), "value": value, "gas": gas, "gasPrice": GAS_PRICE,
              "nonce": self.nonce, "chainId": self.w3.eth.chain_id, "data": data}  # fmt: skip
        self.nonce += 1
        return bytes(self.account.sign_transaction(tx).raw_transaction)

    def send(self, raw: bytes) -> str:
        return "0x" + bytes(self.w3.eth.send_raw_transaction(raw)).hex()

    def balance(self) -> int:
        return int(self.w3.eth.get_balance(self.account.address))

    def block_hash(self, number: int) -> str:
        return "0x" + bytes(self.w3.eth.get_block(number)["hash"]).hex()


@pytest.fixture
def node(devnet: Any) -> Iterator[Node]:  # noqa: F811
    w3 = devnet.w3(NETWORK)
    start = w3.provider.make_request("evm_snapshot", [])["result"]  # type: ignore[arg-type]
    control = Node(w3, devnet.chains)
    control.rpc("evm_setAutomine", False)
    try:
        yield control
    finally:
        control.rpc("evm_revert", start)  # the chain as the other tests left it
        control.rpc("evm_setAutomine", True)


def counts(counter: RpcCounter) -> tuple[int, int, int]:
    return counter.snapshot()


def test_twenty_transactions_in_one_block_take_one_batch_and_an_unmoved_head_one_call(node: Node):
    watcher = BlockWatcher(node.chain(confirmations=1))
    assert watcher.poll() == [] and counts(watcher.counter) == (1, 1, 0)  # nothing tracked: the head only
    before = node.balance()
    hashes = [node.send(node.sign(value=7)) for _ in range(20)]
    for i, tx_hash in enumerate(hashes):
        watcher.track(tx_hash, f"settlement-{i}")
    head = node.mine()

    events = watcher.poll()

    # One call for the head, then ONE batch: the head again and the 20 receipts (no block to check: none was seen
    # mined before).
    assert counts(watcher.counter) == (1 + 1 + 21, 1 + 2, 1)
    mined = [e for e in events if isinstance(e, Mined)]
    final = [e for e in events if isinstance(e, Final)]
    assert len(events) == 40 and len(mined) == 20 and len(final) == 20
    assert {e.tx_hash for e in mined} == {e.tx_hash for e in final} == set(hashes)
    assert {e.key for e in final} == {f"settlement-{i}" for i in range(20)}
    assert {(e.block_number, e.block_hash, e.succeeded) for e in final} == {(head, node.block_hash(head), True)}
    # What the receipts say they cost is what the sender paid beyond the value it sent (on chain).
    assert sum(e.cost_wei for e in final) == before - node.balance() - 20 * 7
    assert all(e.cost_wei == 21_000 * GAS_PRICE for e in final)
    assert watcher.tracked() == {}  # final: no longer read

    # The head has not moved: one call (eth_blockNumber), nothing else.
    assert watcher.poll() == []
    assert counts(watcher.counter) == (1 + 1 + 21 + 1, 1 + 2 + 1, 1)


def test_final_waits_for_the_confirmations(node: Node):
    watcher = BlockWatcher(node.chain(confirmations=3))
    tx_hash = node.send(node.sign())
    watcher.track(tx_hash, "s1")
    block = node.mine()

    events = watcher.poll()
    assert events == [Mined(tx_hash, "s1", block, node.block_hash(block), True, 21_000 * GAS_PRICE)]

    node.mine()
    calls_before = counts(watcher.counter)
    assert watcher.poll() == []  # 2 confirmations of 3
    # The head, then one batch: the head again, the receipt and the canonical block at its height.
    assert tuple(b - a for a, b in zip(calls_before, counts(watcher.counter), strict=True)) == (4, 2, 1)
    assert watcher.tracked() == {tx_hash: "s1"}

    node.mine()
    assert watcher.poll() == [Final(tx_hash, "s1", block, node.block_hash(block), True, 21_000 * GAS_PRICE)]
    assert watcher.tracked() == {}


def test_a_reorg_that_drops_a_mined_transaction_is_seen_and_only_the_canonical_block_is_final(node: Node):
    watcher = BlockWatcher(node.chain(confirmations=3))
    before = node.rpc("evm_snapshot")
    raw = node.sign()
    tx_hash = node.send(raw)
    watcher.track(tx_hash, "s1")
    dropped = node.mine()
    dropped_hash = node.block_hash(dropped)
    assert [type(e) for e in watcher.poll()] == [Mined]

    node.rpc("evm_revert", before)  # the block holding it is gone (and Anvil's pool with it)
    node.mine(2)  # a longer chain without it
    assert node.block_hash(dropped) != dropped_hash
    assert watcher.poll() == [Reorged(tx_hash, "s1")]
    assert watcher.tracked() == {tx_hash: "s1"}  # tracked again as unmined

    node.send(raw)  # sent again (the owner's answer to Reorged/Missing)
    block = node.mine()
    events = watcher.poll()
    assert events == [Mined(tx_hash, "s1", block, node.block_hash(block), True, 21_000 * GAS_PRICE)]
    node.mine()
    assert watcher.poll() == []
    node.mine()
    final = watcher.poll()
    assert final == [Final(tx_hash, "s1", block, node.block_hash(block), True, 21_000 * GAS_PRICE)]
    assert final[0].block_hash != dropped_hash


def test_a_receipt_moved_to_another_block_at_the_same_height_is_reorged_then_mined_there(node: Node):
    watcher = BlockWatcher(node.chain(confirmations=3))
    node.mine()
    raw = node.sign()
    tx_hash = node.send(raw)
    watcher.track(tx_hash, "s1")
    node.mine()  # a block with it
    block = node.mine()  # and one on top
    first = watcher.poll()
    assert [type(e) for e in first] == [Mined] and isinstance(first[0], Mined) and first[0].block_number == block - 1

    # The last two blocks replaced: the transaction lands one block later, at the height of the old head.
    node.rpc("anvil_reorg", 2, [["0x" + raw.hex(), 1]])
    assert node.w3.eth.block_number == block  # same height: not a new head yet
    assert watcher.poll() == []
    head = node.mine()
    events = watcher.poll()
    moved = Mined(tx_hash, "s1", block, node.block_hash(block), True, 21_000 * GAS_PRICE)
    assert events == [Reorged(tx_hash, "s1"), moved]
    assert head - block + 1 == 2  # not final yet
    node.mine()
    assert watcher.poll() == [Final(tx_hash, "s1", block, node.block_hash(block), True, 21_000 * GAS_PRICE)]


def test_a_reverted_transaction_is_mined_as_failed_and_charged(node: Node):
    watcher = BlockWatcher(node.chain(confirmations=1))
    before = node.balance()
    # Calldata the token has no function for: it reverts (and the sender pays its gas).
    tx_hash = node.send(node.sign(to=node.network.usdc_address, value=0, data="0xdeadbeef", gas=100_000))
    watcher.track(tx_hash, "s1")
    block = node.mine()
    events = watcher.poll()
    assert [type(e) for e in events] == [Mined, Final]
    assert all(isinstance(e, Mined | Final) and not e.succeeded and e.block_number == block for e in events)
    receipt = node.w3.eth.get_transaction_receipt(tx_hash)  # type: ignore[arg-type]
    assert receipt["status"] == 0
    assert isinstance(events[0], Mined) and events[0].cost_wei == before - node.balance() > 0


def test_a_transaction_that_never_lands_is_missing_every_n_heads(node: Node):
    watcher = BlockWatcher(node.chain(confirmations=1), missing_after=3)
    watcher.poll()
    never = "0x" + "ab" * 32
    watcher.track(never, "s1")
    node.mine()
    assert watcher.poll() == []  # 1 new head
    node.mine()
    assert watcher.poll() == []
    node.mine()
    assert watcher.poll() == [Missing(never, "s1", 3)]
    node.mine(2)
    assert watcher.poll() == []  # 5 heads: said once per 3
    node.mine()
    assert watcher.poll() == [Missing(never, "s1", 6)]
    watcher.untrack(never)
    node.mine()
    assert watcher.poll() == [] and watcher.tracked() == {}


# --- the batched watch() ---------------------------------------------------------------------------------------


def claim(tx_id: str) -> Claim:
    return Claim(settlement_id="s", intent_id="i", asset="usdc", terms=None, tx_id=tx_id,  # type: ignore[arg-type]
                 relay_address=None, start_block=None)  # fmt: skip


def watch_one_by_one(chain: EvmChain, claims: list[Claim]) -> dict[str, TxStatus]:
    """The watch before batching: one receipt per claim, one transaction read per missing receipt."""
    head = chain.block_number() if chain.network.confirmations > 1 else None
    statuses: dict[str, TxStatus] = {}
    for c in claims:
        assert c.tx_id
        receipt = chain.receipt(c.tx_id)
        if receipt is not None:
            statuses[c.tx_id] = watch_module.status_of(chain, receipt, head)
        else:
            pending = watch_module.is_pending(chain, c.tx_id)
            statuses[c.tx_id] = TxStatus(TxState.PENDING if pending else TxState.UNKNOWN)
    return statuses


def twenty_claims(node: Node) -> tuple[list[Claim], int]:
    """10 transactions mined (one reverted), 9 waiting in the pool, 1 the node never saw."""
    mined = [node.send(node.sign(value=3)) for _ in range(9)]
    mined.append(node.send(node.sign(to=node.network.usdc_address, value=0, data="0xdeadbeef", gas=100_000)))
    block = node.mine()
    pending = [node.send(node.sign(value=3)) for _ in range(9)]
    return [claim(h) for h in [*mined, *pending, "0x" + "cd" * 32]], block


@pytest.mark.parametrize("confirmations", [1, 3])
def test_watch_reads_twenty_claims_in_two_batches_with_the_same_answers(node: Node, confirmations: int):
    chain = node.chain(confirmations=confirmations)
    claims, block = twenty_claims(node)
    counter = watch_module.rpc_counter(chain)

    statuses = watch_module.watch(chain, claims)

    # Receipts in one batch, the 10 missing ones' transactions in a second: 2 round trips (3 with the height).
    assert counts(counter) == (20 + 10, 2, 2)
    assert statuses == watch_one_by_one(chain, claims)  # the answers of one call per claim (30 round trips)
    states = [statuses[c.tx_id].state for c in claims if c.tx_id]
    assert states == [TxState.SUCCEEDED] * 9 + [TxState.FAILED] + [TxState.PENDING] * 9 + [TxState.UNKNOWN]
    first = statuses[claims[0].tx_id or ""]
    assert first.block == block and first.final is (confirmations == 1) and first.cost == 21_000 * GAS_PRICE


class Proxy(RpcProxy):
    """An RPC in front of Anvil that refuses batches (``refuse``) or fails the first call of each that reads a
    transaction or its receipt (``fail_first``)."""

    def __init__(self, upstream: str, mode: str) -> None:
        self.mode = mode
        self.batches = 0
        super().__init__(upstream)

    def handle(self, body: Any) -> Any:
        if isinstance(body, list) and self.mode == "refuse":
            return {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "no batches"}}
        answer = self.forward(body)
        if isinstance(body, list):
            self.batches += 1
            if self.mode == "fail_first":
                first = next(c["id"] for c in body if c["method"].startswith("eth_getTransaction"))
                answer = [{"jsonrpc": "2.0", "id": first, "error": {"code": -32000, "message": "busy"}}
                          if a["id"] == first else a for a in answer]  # fmt: skip
        return answer


@pytest.fixture
def proxy(node: Node) -> Iterator[Proxy]:
    with Proxy(node.network.rpc_url, "refuse") as server:
        yield server


def test_a_node_refusing_batches_is_asked_one_call_each_with_the_same_answers(node: Node, proxy: Proxy):
    chain = node.chain(confirmations=1, rpc_url=proxy.url)
    claims, _ = twenty_claims(node)
    counter = watch_module.rpc_counter(chain)

    assert watch_module.watch(chain, claims) == watch_one_by_one(node.chain(confirmations=1), claims)
    # The refused batch, then 20 receipts and 10 transactions one call each.
    assert counter.batches_refused and counts(counter) == (20 + 20 + 10, 1 + 20 + 10, 1)
    watch_module.watch(chain, claims)  # refused once: not asked for a batch again
    assert counts(counter) == (20 + 20 + 10 + 30, 1 + 20 + 10 + 30, 1)

    # The block watcher falls back the same way.
    watcher = BlockWatcher(chain)
    watcher.track(claims[0].tx_id or "", "s1")
    watcher.track(claims[1].tx_id or "", "s2")
    assert [type(e) for e in watcher.poll()] == [Mined, Final, Mined, Final] and watcher.counter.batches_refused
    # The head; the refused batch (the head again, 2 receipts); then those 3 one call each.
    assert counts(watcher.counter) == (1 + 3 + 3, 1 + 1 + 3, 1)


def test_one_failed_element_of_a_batch_is_asked_again_alone_not_taken_for_unknown(node: Node, proxy: Proxy):
    proxy.mode = "fail_first"
    chain = node.chain(confirmations=1, rpc_url=proxy.url)
    claims, _ = twenty_claims(node)
    assert watch_module.watch(chain, claims) == watch_one_by_one(node.chain(confirmations=1), claims)
    assert proxy.batches == 2

    # The block watcher says nothing about a transaction whose receipt the node failed to give, until next time.
    watcher = BlockWatcher(chain)
    watcher.track(claims[0].tx_id or "", "first")
    watcher.track(claims[1].tx_id or "", "second")
    assert {e.key for e in watcher.poll()} == {"second"}
    assert watcher.tracked() == {claims[0].tx_id: "first"}
    proxy.mode = "pass"
    node.mine()
    assert [(type(e), e.key) for e in watcher.poll()] == [(Mined, "first"), (Final, "first")]


def test_a_transaction_tracked_after_it_was_buried_is_mined_and_final_in_one_poll(node: Node):
    watcher = BlockWatcher(node.chain(confirmations=3))
    tx_hash = node.send(node.sign())
    block = node.mine()
    node.mine(2)
    watcher.track(tx_hash, "late")
    landed = (tx_hash, "late", block, node.block_hash(block), True, 21_000 * GAS_PRICE)
    assert watcher.poll() == [Mined(*landed), Final(*landed)]
    # The head; the head again and the receipt; then the head and the canonical block at its height (read only
    # because it was deep enough).
    assert counts(watcher.counter) == (5, 3, 2)
