"""The pipelined EVM relayer's shared watcher: one background thread per network reads each new head once.

``wait_landed`` of many concurrent settle jobs costs one JSON-RPC batch per new head (``BlockWatcher``), not one
``eth_getTransactionReceipt`` poll per job: a job registers its transaction's hash (``expect``, before it is
broadcast) and sleeps on an ``Event``; the watcher thread polls the head at about a quarter of the block time seen
(at least ``MIN_POLL_SECONDS``, at most ``MAX_POLL_SECONDS``; ``EVM_WATCH_POLL_SECONDS`` fixes it) and wakes every
waiter whose receipt the batch brought.

A transaction the watcher reports ``Missing`` (no receipt for ``missing_after`` new heads) that the node does not
hold any more (``eth_getTransactionByHash`` null) is broadcast again from its signed bytes (kept in memory per hash
while tracked), through its account's lease fence (``Resender``): the very same transaction, same hash and nonce, so
nothing is recorded again. A watcher thread that died is started again by the next waiter; a waiter never waits past
its timeout. A job that replaced its transaction at the same nonce waits on both (``wait_any``): the chain mines one
of them.

With nothing to watch the thread leaves after ``IDLE_EXIT_SECONDS``; the next transaction starts it again. While the
node cannot be read and nobody waits, it backs off, doubling its interval up to ``BACKOFF_MAX_SECONDS`` (a new
transaction or waiter ends the back-off); the first failure of an outage is a warning, the others are debug lines,
and the first read that succeeds again says how many failed.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from backend.chains.evm import EvmChain
from backend.rails.base import TxState, TxStatus
from backend.rails.evm.blocks import DEFAULT_MISSING_AFTER, BlockWatcher, Final, Mined, Missing, Reorged
from backend.rails.evm.rpcbatch import call_one

log = logging.getLogger(__name__)

MIN_POLL_SECONDS = 0.2
MAX_POLL_SECONDS = 1.0
IDLE_EXIT_SECONDS = 30.0  # the thread leaves after this long with nothing to watch
BACKOFF_MAX_SECONDS = 5.0  # the longest interval between failing reads while nobody waits
POLL_ENV = "EVM_WATCH_POLL_SECONDS"  # a fixed poll interval (seconds), else derived from the block time seen
MISSING_ENV = "EVM_WATCH_MISSING_AFTER"  # new heads without a receipt before a transaction counts as missing
# A tracked transaction nobody waits for is forgotten this long after it was expected (the reconciler owns it then).
FORGET_AFTER_SECONDS = 1800.0
# The signed bytes of a forgotten transaction not seen mined are kept this long (``raw_of``: sent again as they are).
KEEP_RAW_SECONDS = 86_400.0
# Set by relayer.worker at start-up (None: nothing): called by a watcher thread right after a round woke settlement
# threads with their receipts, with how many it woke, before they can have recorded anything (the relayer's crash
# point ``after-watch-block``, relayer/faults.py: a process dying with mined settlements not yet recorded).
AFTER_WAKE: Callable[[int], None] | None = None


class Resender(Protocol):
    """The sending account's lease (``fence.Owned``): ``valid`` is a cheap look before the node is asked;
    ``resend`` broadcasts through the lease fence (checked and counted right before the write; False: not sent)."""

    def valid(self) -> bool: ...

    def resend(self, chain: EvmChain, raw: bytes) -> bool: ...


@dataclass
class _Expected:
    event: threading.Event = field(default_factory=threading.Event)
    status: TxStatus | None = None  # the receipt's status once mined (None: not mined, or reorged out)
    raw: bytes | None = None  # the signed transaction, to broadcast again if the node dropped it
    sender: Resender | None = None  # its account's lease: every broadcast again goes through it
    since: float = field(default_factory=time.monotonic)
    waiters: int = 0


class SharedWatcher:
    """One network's watcher thread and the transactions its jobs wait for; thread-safe."""

    def __init__(self, chain: EvmChain, poll_seconds: float | None = None, missing_after: int | None = None) -> None:
        self.chain = chain
        env_missing = os.environ.get(MISSING_ENV, "").strip()
        self.blocks = BlockWatcher(chain, missing_after or int(env_missing or DEFAULT_MISSING_AFTER))
        env_poll = os.environ.get(POLL_ENV, "").strip()
        self.fixed_poll = poll_seconds if poll_seconds is not None else (float(env_poll) if env_poll else None)
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self._kept: dict[str, tuple[float, bytes | None]] = {}  # forgotten, not seen mined: (when, signed bytes)
        self._new: list[str] = []  # expected since the last poll: handed to the BlockWatcher by the thread
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends the thread's pause: set by stop(), and by a new hash during an outage
        self._failures = 0  # failed rounds in a row (only the thread writes it)
        self._heads: deque[float] = deque(maxlen=8)  # when new heads were seen (monotonic)
        self.rebroadcasts = 0
        self._force = False  # hashes were handed to the BlockWatcher and not read yet (only the thread touches it)

    # Jobs
    def expect(self, tx_hash: str, raw: bytes | None = None, sender: Resender | None = None) -> None:
        """Watch ``tx_hash`` from now on (call it before the broadcast, so no head can hold it unread); ``raw`` is
        broadcast again if the node drops it, through ``sender`` (the sending account's lease: checked and counted
        right before the send, so a release waits for it; never sent once the lease is not surely ours)."""
        key = _key(tx_hash)
        with self._lock:
            expected = self._expected.get(key)
            if expected is None:
                self._expected[key] = _Expected(raw=raw, sender=sender)
                self._new.append(key)
            elif raw is not None:
                expected.raw = raw
                expected.sender = sender
        self.ensure_running(wake=True)

    def wait(self, tx_hash: str, timeout: float) -> TxStatus | None:
        """The transaction's status once a new head shows its receipt (``watch.status_of`` with no head), or None
        after ``timeout`` seconds."""
        got = self.wait_any([tx_hash], timeout)
        return got[1] if got is not None else None

    def wait_any(self, tx_hashes: list[str], timeout: float) -> tuple[str, TxStatus] | None:
        """(hash, status) of the first of ``tx_hashes`` a new head shows mined (a transaction and its replacements
        at one nonce: whichever lands), or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        keys = [_key(tx_hash) for tx_hash in tx_hashes]
        waited: list[tuple[str, _Expected]] = []
        with self._lock:  # expected and counted in one locked step: the forget rule cannot drop it in between
            for key in keys:
                expected = self._expected.get(key)
                if expected is None:
                    expected = self._expected[key] = _Expected()
                    self._new.append(key)
                expected.waiters += 1
                expected.since = time.monotonic()
                waited.append((key, expected))
        self.ensure_running(wake=True)
        try:
            while True:
                with self._lock:
                    for key, expected in waited:
                        if expected.status is not None:
                            if expected.waiters == 1 and self._expected.get(key) is expected:
                                del self._expected[key]  # mined and told: the thread stops reading it
                            return key, expected.status
                    for _, expected in waited:
                        expected.event.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.ensure_running()  # a dead watcher thread is started again
                # One event to sleep on (the newest's); the others are looked at again within a poll's time.
                waited[-1][1].event.wait(min(left, 1.0 if len(waited) == 1 else self.poll_seconds()))
        finally:
            with self._lock:
                for _, expected in waited:
                    expected.waiters -= 1

    def replaced(self, tx_hash: str) -> None:
        """A replacement at its nonce took ``tx_hash``'s place in the pool: still watched (either may be mined),
        never broadcast again (its bytes would only be refused as underpriced, or push the replacement out)."""
        key = _key(tx_hash)
        with self._lock:
            expected = self._expected.get(key)
            if expected is not None:
                expected.raw = None
            self._kept.pop(key, None)

    def raw_of(self, tx_hash: str) -> bytes | None:
        """The signed bytes of a transaction of this process not seen mined (None: unknown here, mined, or forgotten
        more than ``KEEP_RAW_SECONDS`` ago: the thread prunes them only while it runs)."""
        key = _key(tx_hash)
        with self._lock:
            expected = self._expected.get(key)
            if expected is not None:
                return expected.raw
            at, raw = self._kept.get(key, (0.0, None))
            return raw if time.monotonic() - at <= KEEP_RAW_SECONDS else None

    def forget(self, tx_hash: str) -> None:
        key = _key(tx_hash)
        with self._lock:
            self._expected.pop(key, None)
            self._kept.pop(key, None)
        # the BlockWatcher is only touched by the thread: it drops untracked hashes on its next round

    # The thread
    def ensure_running(self, wake: bool = False) -> None:
        """Start the thread unless it runs (it sets ``_thread`` to None under the lock as it leaves, so a hash
        expected after that starts another); ``wake``: a new hash or waiter, which ends an outage's back-off."""
        with self._lock:
            if wake and self._failures:
                self._wake.set()
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(
                target=self._run, name=f"evm-watch-{self.chain.network.network}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def poll_seconds(self) -> float:
        if self.fixed_poll is not None:
            return self.fixed_poll
        if len(self._heads) < 3:
            return MIN_POLL_SECONDS
        gaps = [b - a for a, b in zip(self._heads, list(self._heads)[1:], strict=False)]
        return min(max(statistics.median(gaps) / 4, MIN_POLL_SECONDS), MAX_POLL_SECONDS)

    def _run(self) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                if self._expected or self._new or self.blocks.tracked():
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > IDLE_EXIT_SECONDS:
                    if self._thread is threading.current_thread():
                        self._thread = None  # under the lock: the next expect() starts another
                    # What this thread saw is stale for the next one: the head (a transaction tracked then would
                    # count the heads since it as heads without a receipt: "missing" at once, a fee bump too early),
                    # the head times (the idle gap would lengthen the poll) and the failures (a new outage warns).
                    self.blocks.forget_head()
                    self._heads.clear()
                    self._failures = 0
                    return
                self._wake.clear()
            if self._stop.is_set():  # stop() set the wake just cleared: leave now, not after a round's pause
                return
            try:
                self.poll_once()
            except Exception as exc:  # an RPC hiccup: the next round reads again
                self._failures += 1
                if self._failures == 1:
                    log.warning("EVM watcher of %s: %s (more failures at debug level until a read succeeds)",
                                self.chain.network.network, type(exc).__name__)  # fmt: skip
                else:
                    log.debug("EVM watcher of %s: %s", self.chain.network.network, type(exc).__name__)
            else:
                if self._failures:
                    log.info("EVM watcher of %s: reads succeed again after %d failed", self.chain.network.network,
                             self._failures)  # fmt: skip
                self._failures = 0
            self._wake.wait(self._pause())

    def _pause(self) -> float:
        """The interval before the next round: the poll interval, longer while reads fail and nobody waits."""
        with self._lock:
            if not self._failures or any(e.waiters for e in self._expected.values()):
                return self.poll_seconds()
            return min(BACKOFF_MAX_SECONDS, self.poll_seconds() * 2.0 ** min(self._failures, 16))

    def poll_once(self) -> None:
        """One round: hand new hashes to the BlockWatcher, poll it, act on its events."""
        with self._lock:
            new, self._new = self._new, []
            known = set(self._expected)
            now = time.monotonic()
            for key, expected in list(self._expected.items()):
                if expected.waiters == 0 and now - expected.since > FORGET_AFTER_SECONDS:
                    del self._expected[key]
                    known.discard(key)
                    if expected.raw is not None:  # not seen mined: its bytes stay, to send it again at its nonce
                        self._kept[key] = (now, expected.raw)
            for key in [k for k, (at, _) in self._kept.items() if now - at > KEEP_RAW_SECONDS]:
                del self._kept[key]
        for key in new:
            if key in known:
                self.blocks.track(key, key)
        for key in set(self.blocks.tracked()) - known:
            self.blocks.untrack(key)
        head_before = self.blocks.head
        # A hash expected since the last round may be in a head already read: read it even if the head has not moved.
        self._force = self._force or bool(new)
        events = self.blocks.poll(force=self._force)
        self._force = False  # read (a failed poll raised above: the next round reads again)
        if self.blocks.head != head_before:
            self._heads.append(time.monotonic())
        woken: set[str] = set()  # transactions whose waiters this round woke with a receipt (Mined, then Final)
        for event in events:
            if isinstance(event, Mined | Final):
                state = TxState.SUCCEEDED if event.succeeded else TxState.FAILED
                # As ``watch.status_of(chain, receipt, None)``: final only where one confirmation is final (the
                # job's ``wait_final`` and the chain's decision in relayer/tasks.py do the rest).
                status = TxStatus(state, event.block_number, self.chain.network.confirmations <= 1, event.cost_wei)
                if self._settle(event.tx_hash, status):
                    woken.add(event.tx_hash)
            elif isinstance(event, Reorged):
                self._settle(event.tx_hash, None)
            elif isinstance(event, Missing):
                self._missing(event.tx_hash)
        if woken and AFTER_WAKE is not None:
            AFTER_WAKE(len(woken))

    def _settle(self, key: str, status: TxStatus | None) -> bool:
        """Hand ``status`` to the transaction's waiters; whether it woke one with a receipt."""
        with self._lock:
            expected = self._expected.get(key)
            if expected is None:
                return False
            expected.status = status
            if status is not None:
                expected.raw = None  # mined: never broadcast again
            expected.event.set()
            return status is not None and expected.waiters > 0

    def _missing(self, key: str) -> None:
        """Broadcast the same signed transaction again if the node no longer holds it."""
        with self._lock:
            expected = self._expected.get(key)
            raw = expected.raw if expected is not None else None
            sender = expected.sender if expected is not None else None
        if raw is None or (sender is not None and not sender.valid()):
            return  # nothing to send, or not from an account that may be another process's now (a cheap look)
        answer = call_one(self.chain.w3, "eth_getTransactionByHash", [key], self.blocks.counter)
        if not answer.ok or answer.result is not None:
            return  # the node holds it (or said nothing): it waits its turn
        try:
            if sender is None:
                self.chain.w3.eth.send_raw_transaction(raw)
            elif not sender.resend(self.chain, raw):  # the lease checked again right before the send: lost
                log.warning("EVM watcher of %s: %s was dropped by the node; not sent again (the lease of its "
                            "account is not surely ours)", self.chain.network.network, key)  # fmt: skip
                return
            self.rebroadcasts += 1
            log.warning("EVM watcher of %s: %s was dropped by the node; broadcast again", self.chain.network.network,
                        key)  # fmt: skip
        except Exception as exc:
            # "nonce too low": its nonce was taken (mined by another of ours, or a gap's cancel): it can never land.
            log.warning("EVM watcher of %s: broadcasting %s again failed: %s", self.chain.network.network, key, exc)


def _key(tx_hash: str) -> str:
    return "0x" + tx_hash.removeprefix("0x").lower()


_watchers: dict[str, SharedWatcher] = {}
_watchers_lock = threading.Lock()


def shared_watcher(chain: EvmChain) -> SharedWatcher:
    """The process's watcher of ``chain``'s network (started lazily by its first job)."""
    network = chain.network.network
    with _watchers_lock:
        watcher = _watchers.get(network)
        if watcher is None or watcher.chain is not chain:
            if watcher is not None:
                watcher.stop()
            watcher = _watchers[network] = SharedWatcher(chain)
        return watcher
