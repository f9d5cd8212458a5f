"""One signature poller per Solana RPC: many transactions in flight, one status read per tick for all of them.

``relay.submit`` hands the poller each co-signed transaction it sent (``track``); ``relay.wait_landed`` waits on
it (``wait``). A daemon thread, started when the first signature comes and again if it died, ticks every
``TICK_SECONDS``: ONE ``getSignatureStatuses`` for every signature waited on (``MAX_SIGNATURE_STATUSES`` a call,
more calls beyond) and, when a signature has no status or is due to be sent again, one block-height read
(``confirmed``). Then:

- landed (``confirmed``/``finalized``, successful or failed): its waiters wake with the status;
- no status and the height past what the rail's ``may_still_execute`` allows (its blockhash surely expired): it
  can never land, its waiters wake with None ("not landed"; the reconciler's ``read_outcome`` decides EXPIRED by
  its own rules);
- otherwise, every ``RESEND_SECONDS`` while its blockhash may still execute, the very same signed transaction is
  sent again (``skipPreflight``; one signature, so the network executes it at most once and nothing new is
  recorded): a dropped broadcast lands rather than expires (our sends ask the node for no retries). This goes on
  after the last waiter left (a job's wait timed out), until it lands or can never land, at most
  ``RESEND_FOR_SECONDS`` (a blockhash lives ~150 blocks: about a minute, longer with skipped slots). Re-sends take
  at most ``RESEND_BUDGET_SECONDS`` a tick, after the status read; a node that does not answer a send (a timeout,
  no connection) ends that tick's re-sends, so a slow ``sendTransaction`` does not hold back the status reads.

A waiter never waits past its timeout (an RPC call hanging in the thread delays no one's return). A status read
failing ``FAILURES_BEFORE_RAISE`` ticks in a row raises ``SolanaRpcError`` in the waiters, as their own read did.
An outage is logged once (a warning at its first failed read, then debug until a read succeeds again); while the
reads fail and nobody waits (only re-sends are due: the RPC is down, or gone, as a stopped devnet's), the thread
backs off, doubling its interval up to ``BACKOFF_MAX_SECONDS``; a new waiter or signature ends the back-off. With
nothing to poll the thread makes no call, and leaves after ``IDLE_EXIT_SECONDS``; the next signature starts it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from solders.signature import Signature

from backend.chains.solana import MAX_SIGNATURE_STATUSES, SolanaChain, SolanaRpcError

log = logging.getLogger(__name__)

TICK_SECONDS = 0.4  # a Solana slot
RESEND_SECONDS = 2.0
FAILURES_BEFORE_RAISE = 3
IDLE_EXIT_SECONDS = 30.0
BACKOFF_MAX_SECONDS = 5.0  # the longest interval between failing reads while nobody waits
# How long a tracked transaction is polled with no waiter (submit hands it over, then wait_landed waits on it).
UNWAITED_SECONDS = 10.0
# How long a tracked transaction (sent, to send again) may be polled at most with no waiter: past its blockhash's
# life (~150 blocks), which ends it sooner ("can never land").
RESEND_FOR_SECONDS = 300.0
RESEND_BUDGET_SECONDS = 1.0  # the re-sends' share of a tick, at most
RPC_TIMEOUT_SECONDS = 5.0
LANDED = ("confirmed", "finalized")

# Whether a transaction's blockhash may still execute at a block height (the rail's ``may_still_execute``).
StillValid = Callable[[int], bool]


@dataclass
class PollerCounter:
    """What the poller cost: ticks that read statuses, the calls each kind made, re-sends."""

    ticks: int = 0
    status_calls: int = 0
    height_calls: int = 0
    resends: int = 0


@dataclass
class _Entry:
    signature: str
    still_valid: StillValid
    transaction: str | None = None  # the co-signed transaction (base64), to send again; None: watched only
    last_sent: float = 0.0
    waiters: int = 0
    keep_until: float = 0.0  # with no waiter, dropped after this (monotonic)
    status: dict[str, Any] | None = None  # once landed
    done: threading.Event = field(default_factory=threading.Event)


def is_catchable(exc: BaseException) -> bool:
    """solders raises pyo3's ``PanicException`` (a BaseException, not importable by name) on some malformed input:
    a catch-all takes an Exception or that panic, and lets every other BaseException (KeyboardInterrupt,
    SystemExit, the worker's ``StopNow``) go on."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def _raise_fatal(exc: BaseException) -> None:
    if not is_catchable(exc):
        raise exc


def check_signature(signature: str) -> None:
    """A signature the node can be asked about: one malformed signature would fail every waiter's batch."""
    try:
        Signature.from_string(signature)
    except BaseException as exc:
        _raise_fatal(exc)
        raise SolanaRpcError("getSignatureStatuses: malformed signature") from None


class SignaturePoller:
    def __init__(self, chain: SolanaChain, *, tick_seconds: float = TICK_SECONDS) -> None:
        self.chain = chain  # the poller's own client (its own HTTP session), used by its thread only
        self.tick_seconds = tick_seconds
        self.counter = PollerCounter()
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # set by a new signature or waiter: ends a back-off
        self._failures = 0
        self._last_error: SolanaRpcError | None = None
        self._failed_at = 0.0  # the last failed read (monotonic): a waiter that came after it is not told of it

    # --- the callers' side ------------------------------------------------------------------------------

    def track(self, signature: str, transaction: str, still_valid: StillValid) -> None:
        """A co-signed transaction just sent: polled (and sent again while it may execute) until it lands, its
        blockhash expires, or ``RESEND_FOR_SECONDS`` passed."""
        check_signature(signature)
        with self._lock:
            entry = self._entry(signature, still_valid)
            entry.transaction = transaction
            entry.last_sent = time.monotonic()
            entry.keep_until = max(entry.keep_until, entry.last_sent + RESEND_FOR_SECONDS)  # see the module's doc
            self._ensure_running()

    def wait(self, signature: str, still_valid: StillValid, timeout: float) -> dict[str, Any] | None:
        """The signature's status once it landed (``confirmed``); None if it did not within ``timeout`` or can
        never land (no status and its blockhash expired). Raises SolanaRpcError if the node cannot be read."""
        since = time.monotonic()
        deadline = since + timeout
        check_signature(signature)
        with self._lock:
            entry = self._entry(signature, still_valid)
            entry.waiters += 1
            self._ensure_running()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if entry.done.wait(min(remaining, 2 * self.tick_seconds)):
                    return entry.status
                with self._lock:
                    self._ensure_running()  # it died: started again
                    failing = self._failures >= FAILURES_BEFORE_RAISE and self._failed_at > since
                    if failing and self._last_error is not None:
                        raise self._last_error
        finally:
            with self._lock:
                entry.waiters -= 1
                if entry.waiters == 0 and entry.transaction is None:
                    entry.keep_until = time.monotonic()  # watched only: dropped (a sent one is sent again)

    # --- the thread -------------------------------------------------------------------------------------

    def _entry(self, signature: str, still_valid: StillValid) -> _Entry:
        entry = self._entries.get(signature)
        if entry is None:
            entry = self._entries[signature] = _Entry(signature, still_valid)
        entry.keep_until = max(entry.keep_until, time.monotonic() + UNWAITED_SECONDS)
        return entry

    def _ensure_running(self) -> None:  # the lock held
        self._wake.set()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=f"solana-poller-{id(self):x}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            started = time.monotonic()
            with self._lock:
                if not self._entries:
                    if started - idle_since > IDLE_EXIT_SECONDS:
                        self._thread = None  # under the lock: a new signature starts another
                        return
                else:
                    idle_since = started
                self._wake.clear()
            try:
                self.tick()
            except BaseException as exc:
                _raise_fatal(exc)
                log.exception("the Solana signature poller's tick failed")
                self._failed(SolanaRpcError(f"signature poller: {type(exc).__name__}"))
            backoff = self._backoff()
            if backoff:
                self._wake.wait(backoff)
            else:
                time.sleep(max(0.0, self.tick_seconds - (time.monotonic() - started)))

    def _backoff(self) -> float:
        """The pause before the next tick while reads fail and nobody waits (0: none, the next tick is on time)."""
        with self._lock:
            if not self._failures or any(e.waiters for e in self._entries.values()):
                return 0.0
            return min(BACKOFF_MAX_SECONDS, self.tick_seconds * 2.0 ** min(self._failures, 16))

    def _failed(self, error: SolanaRpcError) -> bool:
        """Counts a failed read; True for the first of an outage."""
        with self._lock:
            self._failures += 1
            self._last_error = error
            self._failed_at = time.monotonic()
            return self._failures == 1

    def tick(self) -> None:
        """One poll of every signature waited on (the thread's step; a test may call it alone)."""
        now = time.monotonic()
        with self._lock:
            for signature, entry in list(self._entries.items()):
                if entry.waiters == 0 and now > entry.keep_until:
                    del self._entries[signature]
            entries = list(self._entries.values())
        if not entries:
            return
        self.counter.ticks += 1
        landed: list[tuple[_Entry, dict[str, Any]]] = []
        waiting: list[tuple[_Entry, dict[str, Any] | None]] = []
        height: int | None = None
        try:
            self.counter.status_calls += -(-len(entries) // MAX_SIGNATURE_STATUSES)
            # The recent status cache holds every transaction of ours in flight (its blockhash is still valid).
            statuses = self.chain.signature_statuses([e.signature for e in entries], search_history=False)
            for entry, status in zip(entries, statuses, strict=True):
                if status is not None and status.get("confirmationStatus") in LANDED:
                    landed.append((entry, status))
                else:
                    waiting.append((entry, status))
            due = [e for e, _ in waiting if e.transaction is not None and now - e.last_sent >= RESEND_SECONDS]
            if due or any(status is None for _, status in waiting):  # the height: for expiry and re-sends
                self.counter.height_calls += 1
                height = self.chain.block_height("confirmed")
        except SolanaRpcError as exc:
            if self._failed(exc):
                log.warning("Solana signature poller: %s (more failures at debug level until a read succeeds)", exc)
            else:
                log.debug("Solana signature poller: %s", exc)
            return
        with self._lock:
            if self._failures:
                log.info("Solana signature poller: reads succeed again after %d failed", self._failures)
            self._failures = 0
            self._last_error = None
            for entry, status in landed:
                entry.status = status
                self._finish(entry)
            for entry, status in waiting:
                if status is None and height is not None and not entry.still_valid(height):
                    self._finish(entry)  # can never land: not landed
        again = [e for e in due if height is not None and e.still_valid(height) and not e.done.is_set()]
        if again:
            self._resend(again)

    def _finish(self, entry: _Entry) -> None:  # the lock held
        if self._entries.get(entry.signature) is entry:  # not a newer entry of the same signature
            del self._entries[entry.signature]
        entry.done.set()

    def _resend(self, entries: list[_Entry]) -> None:
        """The very same signed transactions once more, in JSON-RPC batches; what the node did not take is tried
        again at the next re-send (the next status read tells)."""
        sent = time.monotonic()
        for entry in entries:
            entry.last_sent = sent
        self.counter.resends += len(entries)
        transactions = [e.transaction for e in entries if e.transaction is not None]
        taken = self.chain.send_again(transactions, deadline=sent + RESEND_BUDGET_SECONDS)
        if taken < len(entries):
            log.info("Solana signature poller: the node took %d of %d transactions sent again", taken, len(entries))


_pollers: dict[str, SignaturePoller] = {}
_pollers_lock = threading.Lock()


def poller_for(rpc_url: str) -> SignaturePoller:
    """The process's poller of one RPC (per network), with its own client."""
    with _pollers_lock:
        poller = _pollers.get(rpc_url)
        if poller is None:
            poller = _pollers[rpc_url] = SignaturePoller(SolanaChain(rpc_url, timeout=RPC_TIMEOUT_SECONDS))
        return poller
