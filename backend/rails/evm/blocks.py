"""One watcher per EVM chain: each new head is read once, and every tracked transaction's fate with it.

``BlockWatcher`` has no clock and no thread: its owner (the relayer's pipeline) calls ``poll()`` on its own timer.
A poll reads the head (``eth_blockNumber``); if the head has not moved since the last poll, that is all it asks.
On a new head it reads, in ONE JSON-RPC batch, the head again, the receipt of every tracked transaction not final
yet and the canonical block at each height holding a receipt seen before (``eth_getBlockByNumber(n, false)``), and
says what changed as events:

- ``Mined``: a receipt appeared (succeeded or reverted, its block and what it cost the relay);
- ``Final``: the receipt's block is buried under the network's ``confirmations`` (head - block + 1 >= them, the head
  the lower of the poll's and the batch's: behind a load balancer, the batch's node may lag the one that gave the
  head) and its hash is still the canonical hash at that height; with ``confirmations`` <= 1
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
transaction keeps its state until the next new head (an unmined one still counts the heads toward ``Missing``).
A failed batch (a timeout, a connection refused, a rate limit), the first or the second, raises and changes
nothing: the head is not taken as seen and the next poll reads it all again (no event is lost).
"""

from __future__ import annotations

import threading
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
    """The tracked transactions of one chain, and what each new head says about them (module docstring).

    Thread-safe: ``track``/``untrack``/``tracked`` may be called from any thread, also while ``poll`` reads (a lock
    guards the tracked state, never held during I/O; polls run one at a time). A transaction untracked, or
    untracked and tracked again, while a poll reads is left out of that poll's events."""

    def __init__(self, chain: EvmChain, missing_after: int = DEFAULT_MISSING_AFTER) -> None:
        self.chain = chain
        self.missing_after = max(1, missing_after)
        self.counter = RpcCounter()
        self._tracked: dict[str, _Tracked] = {}
        self._head: int | None = None  # the head of the last poll that read everything
        self._lock = threading.Lock()  # the tracked state and the head
        self._polling = threading.Lock()  # one poll at a time (its I/O outside ``_lock``)

    @property
    def head(self) -> int | None:
        """The head of the last complete poll (None before the first)."""
        return self._head

    def forget_head(self) -> None:
        """Nothing is tracked and nobody polls for a while (the watcher thread left): the next poll's head is the
        first seen, so a transaction tracked then counts its heads from it, not from a head long gone."""
        with self._lock:
            self._head = None

    @property
    def confirmations(self) -> int:
        return max(self.chain.network.confirmations, 1)

    def track(self, tx_hash: str, key: str) -> None:
        """Watch ``tx_hash`` (on behalf of ``key``, given back in its events) from the next new head on. Tracking a
        hash already tracked changes its key only."""
        tx_hash = _hash(tx_hash)
        with self._lock:
            tracked = self._tracked.get(tx_hash)
            if tracked is None:
                self._tracked[tx_hash] = _Tracked(key)
            else:
                tracked.key = key

    def untrack(self, tx_hash: str) -> None:
        with self._lock:
            self._tracked.pop(_hash(tx_hash), None)

    def tracked(self) -> dict[str, str]:
        """The tracked hashes (lowercase) and their keys."""
        with self._lock:
            return {tx_hash: tracked.key for tx_hash, tracked in self._tracked.items()}

    def poll(self, force: bool = False) -> list[Event]:
        """Read the head; on a new one (or ``force``: a hash tracked since may be in a head read already), the tracked
        transactions' receipts and their blocks, in one batch (with the head again: depth is judged by the lower of
        the two). Nothing changes unless every read succeeded."""
        with self._polling:
            head = quantity(_result(call_one(self.chain.w3, "eth_blockNumber", [], self.counter), "eth_blockNumber"))
            if head == self._head and not force:
                return []
            with self._lock:
                snapshot = dict(self._tracked)
                landed = {tx_hash: t.landing for tx_hash, t in snapshot.items()}
            reads = self._read(head, landed) if snapshot else None
            with self._lock:
                events = self._apply(snapshot, *reads) if reads is not None else []
                self._head = head
            return events

    def _read(self, poll_head: int, landed: dict[str, _Landing | None]) -> tuple[int, dict[str, Answer], _Canon]:
        """All of a poll's I/O: the batch (head, receipts, canonical blocks at the heights seen before), then the
        canonical block at the height of each new receipt already deep enough (a second batch, only then). Raises
        if a batch fails; changes nothing."""
        hashes = list(landed)
        heights = sorted({landing.block_number for landing in landed.values() if landing is not None})
        calls: list[tuple[str, list[Any]]] = [("eth_blockNumber", [])]
        calls += [("eth_getTransactionReceipt", [tx_hash]) for tx_hash in hashes]
        calls += [("eth_getBlockByNumber", [hex(height), False]) for height in heights]
        answers = call_many(self.chain.w3, calls, self.counter)
        head = min(poll_head, quantity(_result(answers[0], "eth_blockNumber")))
        receipts = dict(zip(hashes, answers[1 : 1 + len(hashes)], strict=True))
        canonical = _canonical(heights, answers[1 + len(hashes) :])
        unverified = sorted(
            {
                landing.block_number
                for answer in receipts.values()
                if answer.ok
                and isinstance(answer.result, Mapping)
                and (landing := _landing(answer.result)) is not None
                and landing.block_number not in canonical
                and head - landing.block_number + 1 >= self.confirmations > 1
            }
        )
        verified: dict[int, str] = {}
        verified_head = head
        if unverified:
            calls = [("eth_blockNumber", []), *(("eth_getBlockByNumber", [hex(h), False]) for h in unverified)]
            answers = call_many(self.chain.w3, calls, self.counter)
            verified_head = min(head, quantity(_result(answers[0], "eth_blockNumber")))
            verified = _canonical(unverified, answers[1:])
        return head, receipts, _Canon(canonical, verified, verified_head)

    def _apply(
        self, snapshot: dict[str, _Tracked], read_head: int, receipts: dict[str, Answer], canon: _Canon
    ) -> list[Event]:
        """The poll's state changes and events (under ``_lock``), for the transactions still tracked as read;
        ``read_head``: the lower of the poll's head and the batch's."""
        canonical = canon.canonical
        events: list[Event] = []
        for tx_hash, answer in receipts.items():
            tracked = self._tracked.get(tx_hash)
            if tracked is not snapshot[tx_hash]:
                continue  # untracked (or tracked anew) while the poll read: the next new head reads it
            if not answer.ok:
                # The node said nothing about it: its state stands; an unmined one still counts toward Missing.
                if tracked.landing is None:
                    events.extend(self._missing(tx_hash, tracked, read_head))
                continue
            receipt = answer.result if isinstance(answer.result, Mapping) else None
            landing = _landing(receipt) if receipt is not None else None
            if landing is not None and canonical.get(landing.block_number, landing.block_hash) != landing.block_hash:
                landing = None  # a stale receipt: the block it names is not the canonical one at its height
            previous = tracked.landing
            moved = canonical.get(previous.block_number, previous.block_hash) if previous is not None else None
            if previous is not None and (landing != previous or moved != previous.block_hash):
                events.append(Reorged(tx_hash, tracked.key))
                tracked.landing, tracked.since, tracked.missing_reported = None, read_head, 0
                previous = None
            if landing is not None and previous is None:
                tracked.landing = landing
                events.append(Mined(tx_hash, tracked.key, *_fields(landing)))
            if tracked.landing is None:
                events.extend(self._missing(tx_hash, tracked, read_head))
                continue
            number, block_hash = tracked.landing.block_number, tracked.landing.block_hash
            if read_head - number + 1 < self.confirmations:
                continue
            if self.confirmations <= 1 or canonical.get(number) == block_hash:
                events.append(self._final(tx_hash, tracked))
            elif number not in canonical and canon.verify(number, block_hash, self.confirmations):
                events.append(self._final(tx_hash, tracked))  # tracked late (or many blocks in one poll)
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


@dataclass(frozen=True)
class _Canon:
    """The canonical block hashes a poll read: at the heights seen before (same batch as the receipts), and at the
    heights of new receipts already deep enough (``verified``, a second batch, with its own head)."""

    canonical: dict[int, str]
    verified: dict[int, str]
    verified_head: int

    def verify(self, number: int, block_hash: str, confirmations: int) -> bool:
        return self.verified.get(number) == block_hash and self.verified_head - number + 1 >= confirmations


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
