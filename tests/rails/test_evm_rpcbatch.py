"""Node misbehaviour Anvil cannot produce, against the EVM rail's batched reads (``rpcbatch``), ``watch`` and
``BlockWatcher``: a scripted JSON-RPC node over real HTTP (``FakeNode``), read through the rail's own ``EvmChain``
(web3's HTTP provider). Each test fails if the guard it names is taken out.

The node answers from its tables (head, receipts, transactions, canonical blocks); ``tamper`` rewrites a batch's
answers (ids, order, contents) the way a broken proxy or load balancer would; ``fail`` answers an error for chosen
calls; ``batch_status`` answers a batch with an HTTP error; ``resets`` drops the connection of the next batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
from web3.exceptions import Web3RPCError

from backend.chains.evm import EvmChain
from backend.chains.registry import Network
from backend.rails.base import Claim, TxState, TxStatus
from backend.rails.evm import watch as watch_module
from backend.rails.evm.blocks import BlockWatcher, Final, Mined, Missing
from backend.rails.evm.rpcbatch import BATCH_RETRY_SECONDS, RpcCounter, call_many, quantity, strict_quantity
from harness.proxy import DropConnection, Reply, RpcServer

A, B = "0x" + "aa" * 32, "0x" + "bb" * 32
GAS = 21_000 * 10**9


def block_hash(number: int) -> str:
    return "0x" + f"{number:064x}"


def receipt(tx_hash: str, block: int | None, status: int = 1) -> dict[str, Any]:
    return {"transactionHash": tx_hash, "blockNumber": None if block is None else hex(block),
            "blockHash": None if block is None else block_hash(block), "status": None if block is None else hex(status),
            "gasUsed": hex(21_000), "effectiveGasPrice": hex(10**9)}  # fmt: skip


class FakeNode(RpcServer):
    def __init__(self) -> None:
        self.head = 10
        self.batch_head: int | None = None  # the head a batch answers (a lagging node behind a load balancer)
        self.receipts: dict[str, dict[str, Any]] = {}
        self.txs: dict[str, dict[str, Any]] = {}
        self.fail: Callable[[str, list[Any], bool], str | None] = lambda method, params, in_batch: None
        self.tamper: Callable[[list[dict[str, Any]]], Any] = lambda answers: answers
        self.batch_status: int | None = None
        self.resets = 0
        self.on_batch: Callable[[], None] = lambda: None
        self.batches: list[list[dict[str, Any]]] = []
        self.singles: list[str] = []
        super().__init__(poll_seconds=0.05)

    def handle(self, body: Any) -> Any:
        if not isinstance(body, list):
            self.singles.append(body["method"])
            return self.answer(body, False)
        self.batches.append(body)
        if self.resets:
            self.resets -= 1
            raise DropConnection  # no answer: the client sees a reset connection
        self.on_batch()
        return Reply(self.tamper([self.answer(call, True) for call in body]), self.batch_status or 200)

    def answer(self, call: dict[str, Any], in_batch: bool) -> dict[str, Any]:
        method, params = call["method"], call["params"]
        message = self.fail(method, params, in_batch)
        if message is not None:
            code = -32005 if "rate" in message else -32000
            return {"jsonrpc": "2.0", "id": call["id"], "error": {"code": code, "message": message}}
        result: Any = None
        if method == "eth_blockNumber":
            result = hex(self.batch_head if in_batch and self.batch_head is not None else self.head)
        elif method == "eth_getBalance":
            result = hex(5)
        elif method == "eth_getTransactionReceipt":
            result = self.receipts.get(params[0].lower())
        elif method == "eth_getTransactionByHash":
            result = self.txs.get(params[0].lower())
        elif method == "eth_getBlockByNumber":
            number = int(params[0], 16)
            result = {"number": params[0], "hash": block_hash(number)} if number <= self.head else None
        return {"jsonrpc": "2.0", "id": call["id"], "result": result}

    def chain(self, confirmations: int = 1) -> EvmChain:
        return EvmChain(Network(network="eip155:84532", name="fake", kind="evm", rpc_url=self.url,
                                usdc_address="0x" + "11" * 20, confirmations=confirmations))  # fmt: skip


@pytest.fixture
def fake() -> Iterator[FakeNode]:
    with FakeNode() as node:
        yield node


def claim(tx_id: str) -> Claim:
    return Claim(settlement_id="s", intent_id="i", asset="usdc", terms=None, tx_id=tx_id,  # type: ignore[arg-type]
                 relay_address=None, start_block=None)  # fmt: skip


# --- watch() -----------------------------------------------------------------------------------------------------


def test_a_pending_receipt_without_a_block_is_pending_not_a_final_failure(fake: FakeNode):
    # H1: some nodes answer a "receipt" with null blockNumber/blockHash/status for a transaction in their pool.
    fake.receipts[A] = receipt(A, None)
    fake.txs[A] = {"hash": A, "blockNumber": None}
    fake.receipts[B] = receipt(B, 7)
    chain = fake.chain()
    assert watch_module.watch(chain, [claim(A)]) == {A: TxStatus(TxState.PENDING)}  # the relayer's one-claim path
    both = watch_module.watch(chain, [claim(A), claim(B)])  # the batch path
    assert both == {A: TxStatus(TxState.PENDING), B: TxStatus(TxState.SUCCEEDED, 7, True, GAS)}
    watcher = BlockWatcher(chain)
    watcher.track(A, "s1")
    assert watcher.poll() == [] and watcher.tracked() == {A: "s1"}


def test_a_transaction_in_a_block_without_a_receipt_yet_is_pending_not_unknown(fake: FakeNode):
    # L1: mined between the receipt read and the transaction read, or a lagging node: never UNKNOWN (a release).
    fake.txs[A] = {"hash": A, "blockNumber": hex(9)}
    chain = fake.chain()
    assert watch_module.watch(chain, [claim(A)]) == {A: TxStatus(TxState.PENDING)}
    assert watch_module.watch(chain, [claim(A), claim(B)]) == {
        A: TxStatus(TxState.PENDING),
        B: TxStatus(TxState.UNKNOWN),
    }


def test_repeated_and_case_variant_hashes_are_read_once_and_answered_each(fake: FakeNode):
    # L5: the same transaction claimed twice, once in capitals: one receipt read, the right status for every claim.
    fake.receipts[A] = receipt(A, 7)
    fake.receipts[B] = receipt(B, 8, status=0)
    upper = "0x" + A[2:].upper()
    chain = fake.chain()
    statuses = watch_module.watch(chain, [claim(A), claim(upper), claim(B), claim(A)])
    assert statuses == {A: TxStatus(TxState.SUCCEEDED, 7, True, GAS), upper: TxStatus(TxState.SUCCEEDED, 7, True, GAS),
                        B: TxStatus(TxState.FAILED, 8, True, GAS)}  # fmt: skip
    assert [[call["params"][0] for call in batch] for batch in fake.batches] == [[A, B]] and fake.singles == []


def dup_ids(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**answer, "id": answers[0]["id"]} for answer in answers]


def str_ids(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**answer, "id": str(answer["id"])} for answer in answers]


def renumbered(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**answer, "id": i} for i, answer in enumerate(answers)]


def one_error(answers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": None, "error": {"code": -32000, "message": "server busy"}}


@pytest.mark.parametrize("tamper", [dup_ids, str_ids, renumbered, one_error], ids=lambda f: f.__name__)
def test_a_batch_whose_ids_are_not_the_ones_sent_is_asked_one_call_each_this_time_only(fake: FakeNode, tamper: Any):
    # M1: a duplicate id used to give both claims the first receipt (both SUCCEEDED); no permanent fallback.
    fake.receipts[A] = receipt(A, 7)
    fake.receipts[B] = receipt(B, 8, status=0)
    fake.tamper = tamper
    chain = fake.chain()
    statuses = watch_module.watch(chain, [claim(A), claim(B)])
    assert statuses == {A: TxStatus(TxState.SUCCEEDED, 7, True, GAS), B: TxStatus(TxState.FAILED, 8, True, GAS)}
    counter = watch_module.rpc_counter(chain)
    assert fake.singles == ["eth_getTransactionReceipt"] * 2 and not counter.batches_refused
    watch_module.watch(chain, [claim(A), claim(B)])
    assert len(fake.batches) == 2  # a batch again next time


def test_answers_out_of_order_are_matched_by_id_and_another_calls_answer_is_asked_again(fake: FakeNode):
    fake.receipts[A] = receipt(A, 7)
    fake.receipts[B] = receipt(B, 8, status=0)
    fake.tamper = lambda answers: list(reversed(answers))  # the spec lets a node answer in any order
    chain = fake.chain()
    expected = {A: TxStatus(TxState.SUCCEEDED, 7, True, GAS), B: TxStatus(TxState.FAILED, 8, True, GAS)}
    assert watch_module.watch(chain, [claim(A), claim(B)]) == expected and fake.singles == []
    # Right ids, swapped contents (a proxy that renumbers): each answer is checked against its call.
    fake.tamper = lambda answers: [{**answers[0], "result": answers[1]["result"]},
                                   {**answers[1], "result": answers[0]["result"]}]  # fmt: skip
    assert watch_module.watch(chain, [claim(A), claim(B)]) == expected
    assert fake.singles == ["eth_getTransactionReceipt"] * 2
    # A block of another height than asked, the same.
    fake.singles.clear()
    calls = [("eth_getBlockByNumber", [hex(5), False]), ("eth_getBlockByNumber", [hex(6), False])]
    answers = call_many(chain.w3, calls, RpcCounter())
    assert [a.result["hash"] for a in answers] == [block_hash(5), block_hash(6)] and len(fake.singles) == 2


# --- refusals, rate limits, resets ---------------------------------------------------------------------------------

READS = [("eth_blockNumber", []), ("eth_getBalance", ["0x" + "22" * 20, "latest"])]


@pytest.mark.parametrize("refusal", [400, 405, 413, 415, -32600, -32601])
def test_a_refused_batch_falls_back_to_one_call_each_then_batches_again_later(fake: FakeNode, refusal: int):
    if refusal > 0:
        fake.batch_status = refusal
    else:
        fake.tamper = lambda answers: {"jsonrpc": "2.0", "id": None, "error": {"code": refusal, "message": "no"}}
    chain, counter = fake.chain(), RpcCounter()
    assert [a.result for a in call_many(chain.w3, READS, counter)] == ["0xa", "0x5"]
    assert counter.batches_refused and len(fake.singles) == 2
    call_many(chain.w3, READS, counter)
    assert len(fake.batches) == 1 and len(fake.singles) == 4  # refused lately: one call each
    assert counter.refused_at is not None
    counter.refused_at -= BATCH_RETRY_SECONDS + 1  # M4: the refusal expires
    fake.batch_status, fake.tamper = None, lambda answers: answers
    assert [a.result for a in call_many(chain.w3, READS, counter)] == ["0xa", "0x5"]
    assert len(fake.batches) == 2 and len(fake.singles) == 4 and not counter.batches_refused


@pytest.mark.parametrize("status", [429, 403, 500, 503])
def test_a_rate_limited_or_failing_rpc_raises_rather_than_giving_up_batches(fake: FakeNode, status: int):
    fake.batch_status = status
    counter = RpcCounter()
    with pytest.raises(requests.HTTPError):
        call_many(fake.chain().w3, READS, counter)
    assert not counter.batches_refused and fake.singles == []


@pytest.mark.parametrize("where", ["batch", "element"])
@pytest.mark.parametrize("error", [{"code": -32005, "message": "limit exceeded"},
                                   {"code": -32000, "message": "Rate limit reached, slow down"}])  # fmt: skip
def test_a_rate_limit_in_a_json_rpc_error_raises_and_never_stops_batches(fake: FakeNode, where: str, error: Any):
    # M4: a rate limit sent as HTTP 200 used to turn batches off for good (and send N single calls right away).
    if where == "batch":
        fake.tamper = lambda answers: {"jsonrpc": "2.0", "id": None, "error": error}
    else:
        fake.tamper = lambda answers: [{"jsonrpc": "2.0", "id": answers[0]["id"], "error": error}, *answers[1:]]
    counter = RpcCounter()
    with pytest.raises(Web3RPCError, match="rate limited"):
        call_many(fake.chain().w3, READS, counter)
    assert not counter.batches_refused and fake.singles == []


def test_a_reset_connection_is_tried_again_once_for_reads_only(fake: FakeNode):
    chain = fake.chain()
    fake.resets = 1
    assert [a.result for a in call_many(chain.w3, READS, RpcCounter())] == ["0xa", "0x5"]
    assert len(fake.batches) == 2
    fake.resets = 2
    with pytest.raises(requests.ConnectionError):
        call_many(chain.w3, READS, RpcCounter())
    assert len(fake.batches) == 4 and fake.singles == []
    # L3: a batch that is not all reads may have been processed: never sent again.
    fake.resets = 1
    with pytest.raises(requests.ConnectionError):
        call_many(chain.w3, [("eth_sendRawTransaction", ["0x00"]), ("eth_blockNumber", [])], RpcCounter())
    assert len(fake.batches) == 5


# --- BlockWatcher ----------------------------------------------------------------------------------------------------


def test_depth_is_judged_by_the_lower_of_the_polls_head_and_the_batchs(fake: FakeNode):
    # M2: the head from one node (10), the receipt and its block from a lagging one (head 7): 2 confirmations, not 5.
    fake.receipts[A] = receipt(A, 6)
    fake.batch_head = 7
    watcher = BlockWatcher(fake.chain(confirmations=3))
    watcher.track(A, "s1")
    assert watcher.poll() == [Mined(A, "s1", 6, block_hash(6), True, GAS)]
    fake.head, fake.batch_head = 11, None
    assert watcher.poll() == [Final(A, "s1", 6, block_hash(6), True, GAS)]


def test_a_second_batch_that_raises_changes_nothing_and_loses_no_event(fake: FakeNode):
    # M3: A is tracked late (deep already): its block is read in a second batch, which fails (a 503). Mined used to
    # be said in the failed poll's lost events, then never again.
    fake.receipts[A] = receipt(A, 5)
    fake.receipts[B] = receipt(B, 9)
    watcher = BlockWatcher(fake.chain(confirmations=3))
    watcher.track(A, "late")
    watcher.track(B, "new")
    fake.on_batch = lambda: setattr(fake, "batch_status", 503 if len(fake.batches) == 2 else None)
    with pytest.raises(requests.HTTPError):
        watcher.poll()
    assert watcher.head is None and watcher.tracked() == {A: "late", B: "new"}
    late = (A, "late", 5, block_hash(5), True, GAS)
    assert watcher.poll() == [Mined(*late), Final(*late), Mined(B, "new", 9, block_hash(9), True, GAS)]


def test_an_error_on_a_block_read_says_nothing_until_the_next_head(fake: FakeNode):
    fake.receipts[A] = receipt(A, 10)
    watcher = BlockWatcher(fake.chain(confirmations=2))
    watcher.track(A, "s1")
    assert [type(e) for e in watcher.poll()] == [Mined]
    fake.head = 11
    fake.fail = lambda method, params, in_batch: "busy" if method == "eth_getBlockByNumber" else None
    assert watcher.poll() == [] and watcher.tracked() == {A: "s1"}  # deep enough, but its block is unread
    fake.head, fake.fail = 12, lambda method, params, in_batch: None
    assert watcher.poll() == [Final(A, "s1", 10, block_hash(10), True, GAS)]


def test_a_receipt_read_that_always_errors_is_still_missing_after_n_heads(fake: FakeNode):
    # L2: it used to stay silent for good.
    fake.fail = lambda method, params, in_batch: "busy" if method == "eth_getTransactionReceipt" else None
    watcher = BlockWatcher(fake.chain(), missing_after=2)
    watcher.poll()
    watcher.track(A, "s1")
    events = []
    for _ in range(3):
        fake.head += 1
        events += watcher.poll()
    assert events == [Missing(A, "s1", 2)]


def test_track_and_untrack_from_other_threads_while_a_poll_reads(fake: FakeNode):
    # M5: the owner's send path tracks and untracks while the watcher thread's poll waits on the node.
    fake.receipts[A] = receipt(A, 9)
    fake.receipts[B] = receipt(B, 9)
    watcher = BlockWatcher(fake.chain())
    watcher.track(A, "a")
    watcher.track(B, "b")

    def meanwhile() -> None:  # runs on the fake node's thread, during the batch
        watcher.untrack(A)
        watcher.untrack(B)
        watcher.track(B, "b again")

    fake.on_batch = meanwhile
    assert watcher.poll() == []  # A is gone; B's new entry is read from the next head on, not with the old read
    assert watcher.tracked() == {B: "b again"}
    fake.on_batch, fake.head = lambda: None, 11
    assert [(type(e), e.key) for e in watcher.poll()] == [(Mined, "b again"), (Final, "b again")]

    # And many threads at once: no error, and what is left tracked is what the threads left.
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(n: int) -> None:
        try:
            while not stop.is_set():
                for i in range(50):
                    watcher.track(f"0x{n:02x}{i:062x}", f"k{n}")
                for i in range(50):
                    watcher.untrack(f"0x{n:02x}{i:062x}")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(20):
            fake.head += 1
            watcher.poll()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == [] and watcher.tracked() == {}


@pytest.mark.parametrize("value", [None, 16, "16", "0x", "0X10", "0x-1", "0x 1", "0x1_0", " 0x10", "0x10\n", "0xg"])
def test_a_strict_quantity_is_0x_and_hex_digits_only(value: Any) -> None:
    """The pre-claim reads' and the fee bump's parse: anything but ``0x`` and hex digits is the node's trouble (an
    error), where the lenient ``quantity`` (the watch's) reads None as 0 and a decimal text as decimal."""
    with pytest.raises(ValueError):
        strict_quantity(value)
    assert strict_quantity("0x10") == strict_quantity("0x0010") == 16 and strict_quantity("0xAb") == 171
    assert quantity(None) == 0 and quantity("16") == 16 and quantity("0x10") == 16
