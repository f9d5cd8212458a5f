"""The relayer's settlement threads: RQ hands each settlement job to one of them and takes the next job.

A settlement spends most of its time waiting for the chain (its receipt, its confirmations), so one process
runs RELAYER_THREADS of them at once and their waits overlap. The hand-off is bounded: a job waits while every
thread is busy, so the queue keeps what this process cannot start (other relayer processes take it meanwhile).

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
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# After a stop signal (and after RQ's own grace for the job it runs, backend.queueing.STOP_GRACE_SECONDS), the
# settlements in progress get this long to finish; the process must be gone before queueing's
# STOP_DEADLINE_SECONDS (15 s) exits it with a failure code.
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

    def submit(self, item: Any) -> None:
        """Hand ``item`` to a free thread, waiting while every thread is busy (in short waits, so a stop
        signal's handler runs in the caller: RQ's job is the caller)."""
        while not self._free.acquire(timeout=0.5):
            pass
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


def finish_in_flight(pool: SettlementPool, *, stopped: bool) -> None:
    """After RQ's worker returned: wait for the settlements in progress.

    ``stopped`` (a stop signal ended the worker): up to STOP_GRACE_SECONDS. Otherwise (``--burst`` drained the
    queue) until they are done, unless a stop signal comes, which starts the grace period. A signal more than a
    second after the one that started the grace ends it at once.
    """
    if threading.current_thread() is not threading.main_thread():  # no signals here (tests run it in a thread)
        pool.wait_idle(STOP_GRACE_SECONDS if stopped else None)
        return
    state = {"since": time.monotonic() if stopped else None, "now": False}

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
