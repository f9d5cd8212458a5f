"""The EVM rail's watch: receipts of our transactions, the pool, confirmations, and what a receipt cost."""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from eth_typing import HexStr
from eth_utils import to_checksum_address
from web3.exceptions import TimeExhausted, TransactionNotFound

from backend.chains.evm import EvmChain
from backend.rails.base import Claim, TxState, TxStatus
from backend.rails.evm.rpcbatch import RpcCounter, call_many, quantity


def gas_cost(receipt: Mapping[str, Any]) -> int:
    """Wei a mined transaction cost its sender: gas used times the effective gas price, plus the L1
    data fee OP-stack chains (Base) add to the receipt."""

    def number(value: Any) -> int:
        if isinstance(value, str):
            return int(value, 16) if value.startswith("0x") else int(value)
        return int(value or 0)

    return number(receipt.get("gasUsed")) * number(receipt.get("effectiveGasPrice")) + number(receipt.get("l1Fee"))


def relay_cost(receipt: Mapping[str, Any] | None, relay_address: str | None) -> int | None:
    """The gas of a mined transaction sent by the relay account ``relay_address`` (None: not mined, not ours)."""
    if receipt is None or not relay_address or str(receipt.get("from") or "").lower() != relay_address.lower():
        return None
    return gas_cost(receipt)


def is_pending(chain: EvmChain, tx_hash: str) -> bool:
    """Whether the node still holds the transaction unmined (so it may yet be mined)."""
    try:
        tx = chain.w3.eth.get_transaction(HexStr(tx_hash))
    except TransactionNotFound:
        return False
    return tx.get("blockNumber") is None


def is_known(chain: EvmChain, tx_hash: str) -> bool:
    """Whether the node has the transaction at all (in its pool or in a block)."""
    try:
        chain.w3.eth.get_transaction(HexStr(tx_hash))
    except TransactionNotFound:
        return False
    return True


def status_of(chain: EvmChain, receipt: Mapping[str, Any], head: int | None) -> TxStatus:
    """A mined transaction. Final at once where one confirmation is final. Else a success is never final here
    (the chain decides once it is buried: the log and its finality read then, in case a reorg dropped it), and a
    revert is final if buried at ``head`` (read before the receipt: a reorg in between cannot make a dropped
    block look final)."""
    block = int(receipt["blockNumber"])
    succeeded = receipt.get("status") == 1
    final = chain.network.confirmations <= 1 or (not succeeded and head is not None and chain.is_final(block, head))
    return TxStatus(TxState.SUCCEEDED if succeeded else TxState.FAILED, block, final, gas_cost(receipt))


def watch(chain: EvmChain, claims: Sequence[Claim]) -> dict[str, TxStatus]:
    """Each claim's transaction: its receipt, else whether the node still holds it. The height is read first
    (once per call) when the network needs more than one confirmation.

    The receipts are read in one JSON-RPC batch, and the transactions of the missing ones in a second
    (``rpcbatch.call_many``: one call each where the node refuses batches). An element the batch answered with an
    error is asked again alone, through web3, and that call's error raises as before: an RPC error is never "not
    mined" or "unknown" (UNKNOWN lets the caller release the claim)."""
    hashes = list(dict.fromkeys(claim.tx_id.lower() for claim in claims if claim.tx_id))  # each once, any case
    statuses = mined_receipts(chain, hashes)
    unmined = [tx_hash for tx_hash in hashes if tx_hash not in statuses]
    answers = call_many(chain.w3, [("eth_getTransactionByHash", [tx_hash]) for tx_hash in unmined], rpc_counter(chain))
    for tx_hash, answer in zip(unmined, answers, strict=True):
        # Known to the node, in its pool or already in a block whose receipt it has not given (a lagging node, or
        # mined between the two reads): PENDING, never UNKNOWN (which lets the caller release the claim).
        known = isinstance(answer.result, Mapping) if answer.ok else is_known(chain, tx_hash)
        statuses[tx_hash] = TxStatus(TxState.PENDING if known else TxState.UNKNOWN)
    # Ours, not held by the node, but its recorded (account, nonce) not consumed on chain yet: another node's pool
    # may still mine it, so PENDING (never UNKNOWN, which lets the caller release the claim or send at a new nonce)
    # until that nonce is taken (the account owner's repair step fills it: the same bytes again, or a cancel).
    unconsumed = [
        claim
        for claim in claims
        if claim.tx_id
        and claim.relay_address
        and claim.relay_nonce is not None
        and statuses[claim.tx_id.lower()].state is TxState.UNKNOWN
    ]
    for claim in unconsumed:
        assert claim.tx_id and claim.relay_address and claim.relay_nonce is not None
        mined = int(chain.w3.eth.get_transaction_count(to_checksum_address(claim.relay_address), "latest"))
        if mined <= claim.relay_nonce:
            statuses[claim.tx_id.lower()] = TxStatus(TxState.PENDING, held=False)
    return {claim.tx_id: statuses[claim.tx_id.lower()] for claim in claims if claim.tx_id}


def mined_receipts(chain: EvmChain, hashes: Sequence[str]) -> dict[str, TxStatus]:
    """The mined ones of ``hashes`` and their status (``status_of``), by lowercase hash: their receipts read in one
    JSON-RPC batch (``rpcbatch.call_many``), the height first (once) when the network needs more than one
    confirmation. An element the batch answered with an error is asked again alone, through web3, and that call's
    error raises: an RPC error is never "not mined". Used by ``watch`` and the fee bump's own look at its hashes."""
    head = chain.block_number() if chain.network.confirmations > 1 else None
    answers = call_many(chain.w3, [("eth_getTransactionReceipt", [tx_hash]) for tx_hash in hashes], rpc_counter(chain))
    statuses: dict[str, TxStatus] = {}
    for tx_hash, answer in zip(hashes, answers, strict=True):
        receipt = receipt_of(answer.result if answer.ok else chain.receipt(tx_hash))
        if receipt is not None:
            statuses[tx_hash.lower()] = status_of(chain, receipt, head)
    return statuses


def receipt_of(raw: Any) -> dict[str, Any] | None:
    """A raw receipt (a JSON-RPC answer, hex quantities) with the fields the rail reads as web3 gives them:
    ``blockNumber`` and ``status`` as ints (``gas_cost`` reads the hex gas fields as they are). None: no receipt,
    or a pending "receipt" without a block (some nodes answer one for a transaction in their pool): not mined."""
    if not isinstance(raw, Mapping) or raw.get("blockNumber") is None or raw.get("blockHash") is None:
        return None
    receipt = dict(raw)
    receipt["blockNumber"] = quantity(receipt.get("blockNumber"))
    if receipt.get("status") is not None:
        receipt["status"] = quantity(receipt["status"])
    return receipt


_counters: weakref.WeakKeyDictionary[EvmChain, RpcCounter] = weakref.WeakKeyDictionary()


def rpc_counter(chain: EvmChain) -> RpcCounter:
    """What ``watch`` asked of this chain's RPC in this process (and whether its node refused a batch)."""
    counter = _counters.get(chain)
    if counter is None:
        counter = _counters[chain] = RpcCounter()
    return counter


def wait_receipt(chain: EvmChain, tx_hash: str, timeout: float) -> dict[str, Any] | None:
    try:
        return dict(chain.w3.eth.wait_for_transaction_receipt(HexStr(tx_hash), timeout=timeout, poll_latency=0.05))
    except TimeExhausted:
        return None


def wait_confirmations(chain: EvmChain, block_number: int, timeout: float) -> bool:
    """Wait until the block is buried under the network's confirmations (1 = mined)."""
    deadline = time.monotonic() + timeout
    while not chain.is_final(block_number):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True
