"""Issue 14 review, Low: one chain whose RPC never answers stalled the whole reconcile job.

Each call to it waited its HTTP timeout five times over (web3's own retries), for every open settlement
of that chain, in turn, ahead of the other chains' settlements, until RQ killed the job; and RQ's
JobTimeoutException (an ``Exception``) was swallowed by the per-settlement ``except Exception``, so the job
did not even end then. Now a pass gives each chain a time budget, an unreachable chain is skipped for
the rest of the pass after one timeout, web3 does not retry timeouts, and RQ's timeout ends the job.

The hung RPC is a real local TCP server that accepts connections and never answers; the other chain is
the devnet's Anvil, with its real token; database and Redis are real.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty

from backend import clock as clock_module
from backend.chains import evm
from backend.chains.registry import ChainRegistry
from backend.settlement import reconcile as reconcile_module
from payintent.eip3009 import sign_authorization
from tests.settlement.test_duplicate import _execute
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import _token, iso  # noqa: F401  (fixture)

HEALTHY = "eip155:84532"
HUNG = "eip155:11155111"
TIMEOUT = 2.0  # the RPC read timeout in this test (10 s in production)


@pytest.fixture
def hung_rpc() -> Iterator[str]:
    """An RPC URL whose server accepts every connection and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # kept open, never read from, never answered
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=2)
        for conn in held:
            conn.close()
        server.close()


def _reconcile_later(registry: ChainRegistry, queue: str) -> dict[str, int]:
    """The worker's reconcile job, 60 s later (it looks only at settlements left alone 30 s)."""
    later = datetime.now(UTC) + timedelta(seconds=60)
    clock_module.set_clock(lambda: later)
    try:
        return reconcile_module.reconcile(registry, None, queue)
    finally:
        clock_module.set_clock(None)


@pytest.fixture
def stalled(iso: Any, hung_rpc: str, monkeypatch: pytest.MonkeyPatch) -> Any:  # noqa: F811
    """Three settlements open on HUNG (the oldest), one on HEALTHY executed on chain by an outsider; then
    HUNG's RPC stops answering. Returns (registry with HUNG hung, HEALTHY's intent id, its tx hash)."""
    monkeypatch.setattr(evm, "RPC_TIMEOUT_SECONDS", TIMEOUT)
    monkeypatch.setattr(reconcile_module.ChainPass, "_troubled", set())
    for i in range(3):
        intent = create_intent(iso.client, iso.shop, 1)
        payload = sign_authorization(iso.devnet.buyer(i).key, requirement(intent, HUNG))
        assert pay(iso.client, iso.shop, intent, HUNG, payload).status_code == 504  # open, no relayer
    intent = create_intent(iso.client, iso.shop, 2)
    payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, HEALTHY))
    assert pay(iso.client, iso.shop, intent, HEALTHY, payload).status_code == 504
    w3, token = _token(iso.devnet, HEALTHY)
    executed = _execute(w3, token, payload)  # executed on chain; only the reconciler can record it
    registry = ChainRegistry([replace(n, rpc_url=hung_rpc) if n.network == HUNG else n for n in iso.devnet.chains])
    return registry, intent["intent_id"], executed


def test_a_hung_rpc_costs_one_timeout_and_the_other_chains_are_reconciled(iso, stalled):  # noqa: F811
    registry, intent_id, executed = stalled
    started = time.monotonic()
    counts = _reconcile_later(registry, iso.queue)
    elapsed = time.monotonic() - started
    row = iso.intent_row(intent_id)
    assert row.status == "paid" and row.tx_hash == executed  # the healthy chain's payment is recorded
    assert iso.devnet.balance(HEALTHY, iso.payout) == 2_000_000
    assert counts["finished"] == 1 and counts["errors"] == 1 and counts["deferred"] == 2, counts
    assert elapsed < 2 * TIMEOUT + 3, f"the pass took {elapsed:.1f}s"  # one timeout, not 5 per call per settlement
    assert HUNG in reconcile_module.ChainPass._troubled  # next pass: the hung chain goes last


def test_rq_job_timeout_ends_the_pass_instead_of_being_swallowed(iso, stalled, monkeypatch):  # noqa: F811
    registry, intent_id, _ = stalled
    monkeypatch.setattr(reconcile_module.ChainPass, "_troubled", set())
    started = time.monotonic()
    # RQ's own death penalty (SIGALRM), as the worker puts around a job, 1 s into the hung RPC's first call.
    with pytest.raises(JobTimeoutException), UnixSignalDeathPenalty(1, JobTimeoutException):
        _reconcile_later(registry, iso.queue)
    assert time.monotonic() - started < TIMEOUT  # ended at RQ's timeout, not after the RPC's
    assert iso.intent_row(intent_id).status == "pending"  # not reached in this pass: the next one records it
