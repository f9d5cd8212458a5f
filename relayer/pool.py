"""The relayer's settlement threads: the relayer's loop hands each settlement it takes to one of them.

A settlement spends most of its time waiting for the chain (its receipt, its confirmations), so one process
runs RELAYER_THREADS of them at once and their waits overlap. The hand-off is bounded: the loop reserves a free
thread before it takes a settlement from its intake list, so the list keeps what this process cannot start (other
relayer processes take it meanwhile) and a stop leaves nothing taken and not handed over.

The threads are daemon threads: a stopped relayer gives the settlements in progress a grace period
(``STOP_GRACE_SECONDS``) and then exits without them. Each one is then left as a crash would leave it: open
in the database, sent again or finished by the reconciler (settlement.reconcile).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# After a stop signal (the relayer's loop ends within about a second of it), the settlements in progress get this
# long to finish; the process must be gone before queueing's STOP_DEADLINE_SECONDS (15 s) exits it with a failure code.
STOP_GRACE_SECONDS = 8.0
_SAME_STOP_SECONDS = 1.0  # a second signal this soon is the same stop (make signals the group and the process)


class SettlementPool:
    """``size`` daemon threads each running ``run(item)`` for one handed-off item at a time."""

    def __init__(self, size: int, run: Callable[[Any], None]) -> None:
        self.size = size
        self._run = run
        self._free = threading.Semaphore(size)
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._in_flight = 0
        for n in range(size):
            threading.Thread(target=self._loop, name=f"settle-{n}", daemon=True).start()

    @property
    def in_flight(self) -> int:
        with self._done:
            return self._in_flight

    def reserve(self, timeout: float) -> bool:
        """Take a free thread for an item :meth:`hand` gives it next; False if none was free within ``timeout`` s."""
        return self._free.acquire(timeout=timeout)

    def reserve_more(self, most: int) -> int:
        """Take up to ``most`` more free threads, not waiting: how many were free."""
        taken = 0
        while taken < most and self._free.acquire(blocking=False):
            taken += 1
        return taken

    def unreserve(self, count: int = 1) -> None:
        """Give back ``count`` reserved threads that got no item."""
        for _ in range(count):
            self._free.release()

    def hand(self, item: Any) -> None:
        """Give ``item`` to a thread reserved for it (:meth:`reserve`, :meth:`reserve_more`)."""
        with self._done:
            self._in_flight += 1
        self._items.put(item)

    def wait_idle(self, timeout: float | None) -> bool:
        """Whether every handed-off item finished within ``timeout`` seconds (None: however long it takes)."""
        with self._done:
            return self._done.wait_for(lambda: self._in_flight == 0, timeout)

    def _loop(self) -> None:
        while True:
            item = self._items.get()
            try:
                self._run(item)
            except BaseException:  # run() logs its own errors; this thread must survive anything
                log.exception("settlement thread: unexpected error")
            finally:
                with self._done:
                    self._in_flight -= 1
                    self._done.notify_all()
                self._free.release()


def finish_in_flight(pool: SettlementPool, *, stopped: bool, signals: Sequence[float] = ()) -> None:
    """After the relayer's loop returned: wait for the settlements in progress.

    ``stopped`` (a stop signal ended the loop): up to STOP_GRACE_SECONDS. Otherwise (``--burst`` drained the
    lists) until they are done, unless a stop signal comes, which starts the grace period. A signal more than a
    second after the one that started the grace ends it at once. ``signals``: when the stop signals that came
    during the loop did (queueing.stop_signal_times): the grace counts from the first, and a later one ends it.
    """
    if threading.current_thread() is not threading.main_thread():  # no signals here (tests run it in a thread)
        pool.wait_idle(STOP_GRACE_SECONDS if stopped else None)
        return
    first = signals[0] if signals else (time.monotonic() if stopped else None)
    state = {"since": first, "now": any(t - signals[0] >= _SAME_STOP_SECONDS for t in signals[1:])}

    def on_signal(signum: int, _frame: Any) -> None:
        since = state["since"]
        if since is None:
            state["since"] = time.monotonic()
        elif time.monotonic() - since >= _SAME_STOP_SECONDS:
            state["now"] = True

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in stop_signals}
    for sig in stop_signals:
        signal.signal(sig, on_signal)
    try:
        while not state["now"] and not pool.wait_idle(0.2):
            since = state["since"]
            if since is not None and time.monotonic() - since >= STOP_GRACE_SECONDS:
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    left = pool.in_flight
    if left:
        log.warning("relayer: stopping with %d settlement(s) in progress; they stay open and the reconciler "
                    "finishes them", left)  # fmt: skip
