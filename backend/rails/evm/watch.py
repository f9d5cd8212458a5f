"""The EVM rail's watch: receipts of our transactions, the pool, confirmations, and what a receipt cost."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from eth_typing import HexStr
from web3.exceptions import TimeExhausted, TransactionNotFound

from backend.chains.evm import EvmChain
from backend.rails.base import Claim, TxState, TxStatus


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
    (once per call) when the network needs more than one confirmation."""
    head = chain.block_number() if chain.network.confirmations > 1 else None
    statuses: dict[str, TxStatus] = {}
    for claim in claims:
        if not claim.tx_id:
            continue
        receipt = chain.receipt(claim.tx_id)
        if receipt is not None:
            statuses[claim.tx_id] = status_of(chain, receipt, head)
        else:
            state = TxState.PENDING if is_pending(chain, claim.tx_id) else TxState.UNKNOWN
            statuses[claim.tx_id] = TxStatus(state)
    return statuses


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
