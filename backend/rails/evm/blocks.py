"""One watcher per EVM chain: each new head is read once, and every tracked transaction's fate with it.

``BlockWatcher`` has no clock and no thread: its owner (the relayer's pipeline) calls ``poll()`` on its own timer.
A poll reads the head (``eth_blockNumber``); if the head has not moved since the last poll, that is all it asks.
On a new head it reads, in ONE JSON-RPC batch, the receipt of every tracked transaction not final yet and the
canonical block at each height holding a receipt seen before (``eth_getBlockByNumber(n, false)``), and says what
changed as events:

- ``Mined``: a receipt appeared (succeeded or reverted, its block and what it cost the relay);
- ``Final``: the receipt's block is buried under the network's ``confirmations`` (head - block + 1 >= them, the head
  read before the receipt) and its hash is still the canonical hash at that height; with ``confirmations`` <= 1
  ``Final`` comes with ``Mined``. A final transaction is no longer tracked (no more reads, no more events);
- ``Reorged``: a transaction seen mined has no receipt any more, its receipt names another block, or the canonical
  block at its height is another: it is tracked again as unmined (``Mined`` follows when it lands again, in the
  same poll if the receipt read shows it elsewhere already);
- ``Missing``: no receipt for ``missing_after`` new heads since it was tracked (or reorged out), then again every
  ``missing_after`` heads: the owner asks the pool, sends it again or gives up (``untrack``).

A lagging node behind a load balancer may answer "no receipt" for a mined transaction: ``Reorged`` then ``Mined``
again, never a wrong ``Final`` (``Reorged`` only means "not final after all").
A receipt whose height's canonical block (read in the same batch) is another block is a stale answer of a node
behind a reorg: it is not taken as mined. An element the node answered with an error says nothing: that
transaction keeps its state until the next new head. A failed batch (a timeout, a connection refused) raises
and the head is not taken as seen: the next poll reads it all again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from web3.exceptions import Web3RPCError

from backend.chains.evm import EvmChain
from backend.rails.evm.rpcbatch import Answer, RpcCounter, call_many, call_one, quantity
from backend.rails.evm.watch import gas_cost

# A transaction with no receipt for this many new heads is reported ``Missing`` (then again every as many heads).
DEFAULT_MISSING_AFTER = 20


@dataclass(frozen=True)
class Mined:
    tx_hash: str
    key: str
    block_number: int
    block_hash: str
    succeeded: bool
    cost_wei: int


@dataclass(frozen=True)
class Final:
    tx_hash: str
    key: str
    block_number: int
    block_hash: str
    succeeded: bool
    cost_wei: int


@dataclass(frozen=True)
class Reorged:
    tx_hash: str
    key: str


@dataclass(frozen=True)
class Missing:
    tx_hash: str
    key: str
    heads: int  # new heads seen with no receipt since it was tracked (or reorged out)


Event = Mined | Final | Reorged | Missing


@dataclass(frozen=True)
class _Landing:
    block_number: int
    block_hash: str
    succeeded: bool
    cost_wei: int


@dataclass
class _Tracked:
    key: str
    landing: _Landing | None = None  # seen mined there (not final yet)
    since: int | None = None  # the head of the first poll that saw it unmined (None: not polled since tracked)
    missing_reported: int = 0  # how many times ``Missing`` was said since ``since``


class BlockWatcher:
    """The tracked transactions of one chain, and what each new head says about them (module docstring)."""

    def __init__(self, chain: EvmChain, missing_after: int = DEFAULT_MISSING_AFTER) -> None:
        self.chain = chain
        self.missing_after = max(1, missing_after)
        self.counter = RpcCounter()
        self._tracked: dict[str, _Tracked] = {}
        self._head: int | None = None  # the head of the last poll that read everything

    @property
    def head(self) -> int | None:
        """The head of the last complete poll (None before the first)."""
        return self._head

    @property
    def confirmations(self) -> int:
        return max(self.chain.network.confirmations, 1)

    def track(self, tx_hash: str, key: str) -> None:
        """Watch ``tx_hash`` (on behalf of ``key``, given back in its events) from the next new head on. Tracking a
        hash already tracked changes its key only."""
        tx_hash = _hash(tx_hash)
        tracked = self._tracked.get(tx_hash)
        if tracked is None:
            self._tracked[tx_hash] = _Tracked(key)
        else:
            tracked.key = key

    def untrack(self, tx_hash: str) -> None:
        self._tracked.pop(_hash(tx_hash), None)

    def tracked(self) -> dict[str, str]:
        """The tracked hashes (lowercase) and their keys."""
        return {tx_hash: tracked.key for tx_hash, tracked in self._tracked.items()}

    def poll(self, force: bool = False) -> list[Event]:
        """Read the head; on a new one (or ``force``: a hash tracked since may be in a head read already), the
        tracked transactions' receipts and their blocks, in one batch."""
        head = _result(call_one(self.chain.w3, "eth_blockNumber", [], self.counter), "eth_blockNumber")
        head_number = quantity(head)
        if head_number == self._head and not force:
            return []
        events: list[Event] = []
        if self._tracked:
            events = self._read(head_number)
        self._head = head_number
        return events

    def _read(self, head: int) -> list[Event]:
        hashes = list(self._tracked)
        heights = sorted({t.landing.block_number for t in self._tracked.values() if t.landing is not None})
        calls: list[tuple[str, list[Any]]] = [("eth_getTransactionReceipt", [tx_hash]) for tx_hash in hashes]
        calls += [("eth_getBlockByNumber", [hex(height), False]) for height in heights]
        answers = call_many(self.chain.w3, calls, self.counter)
        canonical = _canonical(heights, answers[len(hashes) :])
        events: list[Event] = []
        unverified: list[str] = []  # new receipts deep enough to be final, their block's hash not read yet
        for tx_hash, answer in zip(hashes, answers[: len(hashes)], strict=True):
            if not answer.ok:
                continue  # the node said nothing about it: its state stands until the next head
            tracked = self._tracked[tx_hash]
            receipt = answer.result if isinstance(answer.result, Mapping) else None
            landing = _landing(receipt) if receipt is not None else None
            if landing is not None and canonical.get(landing.block_number, landing.block_hash) != landing.block_hash:
                landing = None  # a stale receipt: the block it names is not the canonical one at its height
            previous = tracked.landing
            moved = canonical.get(previous.block_number, previous.block_hash) if previous is not None else None
            if previous is not None and (landing != previous or moved != previous.block_hash):
                events.append(Reorged(tx_hash, tracked.key))
                tracked.landing, tracked.since, tracked.missing_reported = None, head, 0
                previous = None
            if landing is not None and previous is None:
                tracked.landing = landing
                events.append(Mined(tx_hash, tracked.key, *_fields(landing)))
            if tracked.landing is None:
                events.extend(self._missing(tx_hash, tracked, head))
                continue
            if head - tracked.landing.block_number + 1 < self.confirmations:
                continue
            if self.confirmations <= 1 or canonical.get(tracked.landing.block_number) == tracked.landing.block_hash:
                events.append(self._final(tx_hash, tracked))
            elif tracked.landing.block_number not in canonical:
                unverified.append(tx_hash)
        events.extend(self._verify(unverified))
        return events

    def _verify(self, hashes: list[str]) -> list[Event]:
        """Final events for new receipts already deep enough (tracked late, or many blocks in one poll) whose block is
        still the canonical one at its height: a second batch, only then."""
        if not hashes:
            return []
        heights = sorted({landing.block_number for h in hashes if (landing := self._tracked[h].landing) is not None})
        calls: list[tuple[str, list[Any]]] = [("eth_getBlockByNumber", [hex(height), False]) for height in heights]
        canonical = _canonical(heights, call_many(self.chain.w3, calls, self.counter))
        events: list[Event] = []
        for tx_hash in hashes:
            tracked = self._tracked[tx_hash]
            landing = tracked.landing
            if landing is not None and canonical.get(landing.block_number) == landing.block_hash:
                events.append(self._final(tx_hash, tracked))
        return events

    def _final(self, tx_hash: str, tracked: _Tracked) -> Final:
        landing = tracked.landing
        assert landing is not None
        del self._tracked[tx_hash]  # final: no more reads
        return Final(tx_hash, tracked.key, *_fields(landing))

    def _missing(self, tx_hash: str, tracked: _Tracked, head: int) -> list[Event]:
        if tracked.since is None:
            tracked.since = self._head if self._head is not None else head
        heads = max(head - tracked.since, 0)
        if heads < self.missing_after * (tracked.missing_reported + 1):
            return []
        tracked.missing_reported += 1
        return [Missing(tx_hash, tracked.key, heads)]


def _hash(tx_hash: str) -> str:
    return "0x" + tx_hash.removeprefix("0x").lower()


def _result(answer: Answer, method: str) -> Any:
    if not answer.ok:
        raise Web3RPCError(f"{method}: {answer.error}")  # as web3 raises an RPC's error
    return answer.result


def _landing(receipt: Mapping[str, Any]) -> _Landing | None:
    if receipt.get("blockHash") is None or receipt.get("blockNumber") is None:
        return None  # a pending "receipt" (some nodes answer one without a block)
    return _Landing(
        block_number=quantity(receipt["blockNumber"]),
        block_hash=_hash(str(receipt["blockHash"])),
        succeeded=quantity(receipt.get("status")) == 1,
        cost_wei=gas_cost(receipt),
    )


def _fields(landing: _Landing) -> tuple[int, str, bool, int]:
    return landing.block_number, landing.block_hash, landing.succeeded, landing.cost_wei


def _canonical(heights: list[int], answers: list[Answer]) -> dict[int, str]:
    """Height -> canonical block hash, for the heights the node answered with a block (not an error, not null)."""
    hashes: dict[int, str] = {}
    for height, answer in zip(heights, answers, strict=True):
        if answer.ok and isinstance(answer.result, Mapping) and answer.result.get("hash"):
            hashes[height] = _hash(str(answer.result["hash"]))
    return hashes
