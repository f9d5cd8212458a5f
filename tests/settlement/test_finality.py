"""A careful operator's `confirmations > 1`: a payment on chain but not final is neither paid nor released.

Issue 14, Medium 4: the reconciler took "executed, fewer than `confirmations` blocks on top" for
"unused" and, once the chain's clock passed validBefore + 60 s, released the intent as
AUTHORIZATION_EXPIRED although the buyer's USDC had moved; nothing corrected it later. And the
relayer took a height past the receipt's block for finality even if a reorg had dropped that block.

Real Anvil chain and token; mining is paused (`evm_setAutomine false`) and blocks are mined by hand,
the chain's clock moved with `evm_setNextBlockTimestamp`, a reorg made with `evm_snapshot`/`evm_revert`.
The chain is put back as it was after each test (snapshot), so the session's other tests see no change.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from sqlalchemy import select, update
from web3 import Web3

from backend import clock as clock_module
from backend.chains.evm import evm_chain
from backend.chains.registry import ChainRegistry
from backend.events.models import Event
from backend.extensions import db
from backend.intents.models import Intent
from backend.rails.evm.outcome import EXPIRY_GRACE_SECONDS
from backend.rails.evm.relay import LEASE_KEY, NONCE_KEY
from backend.settlement.models import Settlement
from backend.settlement.reconcile import reconcile
from backend.settlement.tasks import reconcile_settlements
from backend.worker import PERIODIC
from payintent.eip3009 import sign_authorization
from relayer.faults import CRASH_EXIT_CODE
from tests.conftest import make_settings, truncate_all
from tests.settlement.conftest import start_relayer, stop_process
from tests.settlement.test_duplicate import _execute
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_payer_code import relay_addresses
from tests.settlement.test_recovery import Isolated, _token

NETWORK = "eip155:84532"
CONFIRMATIONS = 3
RECONCILE_EVERY = next(p.every_seconds for p in PERIODIC if p.func is reconcile_settlements)  # the worker's: 15 s


class ChainControl:
    """The devnet chain's mining and clock, by hand."""

    def __init__(self, w3: Web3) -> None:
        self.w3 = w3

    def rpc(self, method: str, *params: Any) -> Any:
        response = self.w3.provider.make_request(method, list(params))  # type: ignore[arg-type]
        assert "error" not in response, (method, response)
        return response["result"]

    def pause(self) -> None:
        self.rpc("evm_setAutomine", False)

    def mine(self, blocks: int = 1, timestamp: int | None = None) -> int:
        if timestamp is not None:
            self.rpc("evm_setNextBlockTimestamp", timestamp)
        for _ in range(blocks):
            self.rpc("evm_mine")
        return int(self.w3.eth.block_number)

    def wait_in_pool(self, tx_hash: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.w3.eth.get_transaction(tx_hash)  # type: ignore[arg-type]
                return
            except Exception:
                assert time.monotonic() < deadline, f"{tx_hash} never reached the node"
                time.sleep(0.1)


@pytest.fixture
def chain(devnet: Any, redis_server_url: str) -> Iterator[ChainControl]:
    control = ChainControl(devnet.w3(NETWORK))
    start = control.rpc("evm_snapshot")
    try:
        yield control
    finally:
        control.rpc("evm_setIntervalMining", 0)
        control.rpc("evm_revert", start)  # the chain (and its clock) as the other tests left it
        control.rpc("evm_setAutomine", True)
        # The relay accounts' nonce hints name transactions the revert undid: the next relayer would cancel their
        # nonces at its start (an extra transaction in another test's count).
        Redis.from_url(redis_server_url).delete(*[NONCE_KEY.format(NETWORK, a) for a in relay_addresses(devnet)])


class Careful(Isolated):
    """An isolated service (own relayer queue) whose chains file asks CONFIRMATIONS on NETWORK."""

    chains: ChainRegistry
    chains_file: str
    logs: Path  # each relayer's output, one file per process (``relayer_output``)

    def relayer(self, fault: str | None = None, **env: str) -> Any:
        """A relayer on this test's queue and chains file, its output (at INFO unless the tests' relayer log level
        is set) kept in a file under the test's tmp_path: a failure shows it (``explained``)."""
        level = os.environ.get("PAYINTENT_TEST_RELAYER_LOG_LEVEL", "INFO")
        extra = {"RELAYER_QUEUE": self.queue, "CHAINS_FILE": self.chains_file, "LOG_LEVEL": level,
                 **({"PAYINTENT_FAULT": fault} if fault else {}), **env}  # fmt: skip
        self.logs.mkdir(exist_ok=True)
        log_file = self.logs / f"relayer-{len(list(self.logs.iterdir()))}-{fault or 'healthy'}.log"
        log_file.write_text(f"--- relayer {fault=} started {datetime.now(UTC).isoformat()}\n")
        return start_relayer(self.db_url, self.redis_url, self.chains_file, log_file=log_file, **extra)

    def relayer_output(self) -> str:
        if not self.logs.is_dir():
            return "(no relayer started)"
        files = sorted(self.logs.iterdir(), key=lambda f: int(f.name.split("-")[1]))
        return "\n".join(f"=== {f}\n{f.read_text(errors='replace')}" for f in files)

    @contextlib.contextmanager
    def explained(self, intent_id: str) -> Iterator[None]:
        """A failing assertion inside says what the relayers wrote and what the settlement row holds."""
        try:
            yield
        except AssertionError as exc:
            try:
                row, intent = self.settlement(intent_id), self.intent_row(intent_id).status
                state = (f"settlement {row.id}: status={row.status} tx_hash={row.tx_hash} relay={row.relay_address} "
                         f"nonce={row.relay_nonce} failure={row.failure_code}; intent {intent}")  # fmt: skip
            except Exception as err:  # the message must not hide the failure
                state = f"(settlement row unreadable: {err!r})"
            raise AssertionError(f"{exc}\n{state}\nrelayer output:\n{self.relayer_output()}") from exc

    def wait_paid_reconciling(self, intent_id: str, timeout: float = 90) -> Intent:
        """``wait_paid``, with the reconciler's pass every RECONCILE_EVERY seconds meanwhile (the worker's schedule):
        a relayer's job that leaves the settlement open (``LeftOpen``) is sent again by the next pass."""
        deadline = time.monotonic() + timeout
        passes: list[dict[str, int]] = []
        next_pass = time.monotonic() + RECONCILE_EVERY
        while time.monotonic() < deadline:
            row = self.intent_row(intent_id)
            if row.status == "paid":
                return row
            if time.monotonic() >= next_pass:
                passes.append(self.reconcile_later(300))
                next_pass = time.monotonic() + RECONCILE_EVERY
            time.sleep(0.1)
        raise AssertionError(f"intent {intent_id} did not become paid (reconciler passes meanwhile: {passes})")

    def reconcile_later(self, seconds: int = 60) -> dict[str, int]:
        later = datetime.now(UTC) + timedelta(seconds=seconds)
        clock_module.set_clock(lambda: later)
        try:
            return reconcile(self.chains, Redis.from_url(self.redis_url), self.queue)
        finally:
            clock_module.set_clock(None)

    def events(self, kind: str, intent_id: str) -> list[dict[str, Any]]:
        db.session.expire_all()
        rows = db.session.scalars(select(Event).where(Event.type == kind, Event.intent_id == intent_id))
        return [json.loads(r.payload)["data"] for r in rows]


@pytest.fixture
def careful(db_url: str, redis_server_url: str, devnet: Any, tmp_path: Path) -> Iterator[Careful]:
    from backend.app import create_app

    document = json.loads(Path(devnet.info["chains_file"]).read_text())
    for network in document["networks"]:
        if network["network"] == NETWORK:
            network["confirmations"] = CONFIRMATIONS
    chains_file = tmp_path / "chains.json"
    chains_file.write_text(json.dumps(document))
    registry = ChainRegistry.load(str(chains_file))
    queue = f"relayer-test-{uuid.uuid4().hex[:8]}"
    truncate_all(db_url)
    settings = make_settings(db_url, redis_url=redis_server_url, chains_file=str(chains_file), relayer_queue=queue,
                             pay_wait_seconds=3)  # fmt: skip
    app = create_app(settings, chains=registry)
    with app.app_context():
        handle = Careful(app, queue, db_url, redis_server_url, devnet)
        handle.chains, handle.chains_file, handle.logs = registry, str(chains_file), tmp_path / "relayers"
        yield handle
        db.session.remove()
        db.engine.dispose()


def test_an_executed_payment_short_of_its_confirmations_is_never_released_then_paid(careful, chain):
    intent = create_intent(careful.client, careful.shop, 2)
    intent_id = intent["intent_id"]
    payload = sign_authorization(careful.devnet.buyer(0).key, requirement(intent, NETWORK))
    chain.pause()
    crashing = careful.relayer(fault="after-broadcast")  # the relayer dies once the transaction is out
    try:
        assert pay(careful.client, careful.shop, intent, NETWORK, payload).status_code == 504
        assert crashing.wait(timeout=60) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    settlement = careful.settlement(intent_id)
    assert settlement.status == "submitted" and settlement.tx_hash
    chain.wait_in_pool(settlement.tx_hash)
    executed_in = chain.mine()  # the payment executes: 1 confirmation of 3
    assert careful.devnet.w3(NETWORK).eth.get_transaction_receipt(settlement.tx_hash)["blockNumber"] == executed_in
    assert careful.devnet.balance(NETWORK, careful.payout) == 2_000_000  # the buyer's USDC moved
    # Mining is slow and the chain's clock passes validBefore + 60 s: 2 confirmations of 3.
    chain.mine(timestamp=int(payload["validBefore"]) + EXPIRY_GRACE_SECONDS + 30)

    counts = careful.reconcile_later()
    assert counts["finished"] == 0 and counts["waiting"] == 1 and counts["resent"] == 0
    assert careful.settlement(intent_id).status == "submitted"
    row = careful.intent_row(intent_id)
    assert row.status == "pending" and row.settlement_id == settlement.id  # still claimed: not released
    assert careful.events("payment.failed", intent_id) == []
    second = sign_authorization(careful.devnet.buyer(1).key, requirement(intent, NETWORK))
    refused = pay(careful.client, careful.shop, intent, NETWORK, second)  # nobody can pay it a second time
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "PAYMENT_IN_PROGRESS"

    chain.mine()  # the third confirmation: final
    assert careful.reconcile_later(300)["finished"] == 1
    row = careful.intent_row(intent_id)
    assert row.status == "paid" and row.tx_hash == settlement.tx_hash
    assert row.buyer_address == careful.devnet.buyer(0).address
    (completed,) = careful.events("payment.completed", intent_id)
    assert completed["tx_hash"] == settlement.tx_hash
    assert careful.events("payment.failed", intent_id) == []
    assert careful.devnet.balance(NETWORK, careful.payout) == 2_000_000  # once


def test_a_reorg_that_undoes_the_payment_is_not_paid_and_the_payment_is_sent_again(careful, chain):
    from backend.rails.evm.watch import status_of
    from backend.rails.registry import rail_for
    from backend.settlement.models import settlement_claim
    from relayer.tasks import _finish

    intent = create_intent(careful.client, careful.shop, 3)
    intent_id = intent["intent_id"]
    with careful.explained(intent_id):  # a failure shows the relayers' output
        payload = sign_authorization(careful.devnet.buyer(1).key, requirement(intent, NETWORK))
        chain.pause()
        crashing = careful.relayer(fault="before-finish")  # dies after it has read the receipt
        try:
            assert pay(careful.client, careful.shop, intent, NETWORK, payload).status_code == 504
            tx_hash = careful.wait_settlement(intent_id, "submitted").tx_hash
            assert tx_hash
            chain.wait_in_pool(tx_hash)
            fork = chain.rpc("evm_snapshot")  # the chain before the payment's block
            chain.mine()
            assert crashing.wait(timeout=60) == CRASH_EXIT_CODE
        finally:
            stop_process(crashing)
        w3 = careful.devnet.w3(NETWORK)
        receipt = dict(w3.eth.get_transaction_receipt(tx_hash))  # what the relayer saw before it waited
        assert receipt["status"] == 1 and careful.devnet.balance(NETWORK, careful.payout) == 3_000_000
        careful.reconcile_later()  # executed, not final: neither paid nor released
        assert careful.intent_row(intent_id).status == "pending" and careful.settlement(intent_id).status == "submitted"

        chain.rpc("evm_revert", fork)  # a reorg: the payment's block is replaced ...
        chain.pause()
        chain.mine(CONFIRMATIONS)  # ... by empty blocks, deeper than the confirmations
        assert careful.devnet.balance(NETWORK, careful.payout) == 0  # the money did not move after all
        # The relayer, back from waiting for the receipt's confirmations, must not take the height for finality.
        settlement = careful.settlement(intent_id)
        network = careful.chains.get(NETWORK)
        landed = status_of(evm_chain(network), receipt, None)  # what the relayer saw, as its rail's watch says it
        outcome = _finish(rail_for(network), network, settlement, settlement_claim(settlement), landed)
        row = careful.intent_row(intent_id)
        assert row.status == "pending" and row.tx_hash is None, outcome  # not paid with money that never moved
        assert careful.events("payment.completed", intent_id) == []
        assert outcome == "reorged-out"
        assert careful.settlement(intent_id).status == "submitted"  # still claimed, still valid

        # The reconciler finds it unused and still valid: it is sent again, and this time it stays.
        chain.rpc("evm_setIntervalMining", 1)
        # Its recorded nonce is unconsumed again (the reorg): sent again only at that (account, nonce), by a process
        # that owns the account (review-evmwait M2). The crashed process's lease, as if its 30 s had passed:
        crashed = careful.settlement(intent_id).relay_address
        Redis.from_url(careful.redis_url).delete(LEASE_KEY.format(NETWORK, crashed))
        healthy = careful.relayer()
        try:
            assert careful.reconcile_later(300)["resent"] == 1
            # Not the only pass: the session's relayer (tests/settlement/conftest.py, same devnet, Redis and database)
            # may adopt the crashed account once its lease is gone (AccountPool.adopt: a recorded nonce not mined)
            # and fill that nonce with a cancel; a send that meets the account held by it is left open
            # ("waiting-for-chain") for the reconciler's next pass, as in production, which sends it at a new nonce.
            row = careful.wait_paid_reconciling(intent_id, timeout=90)
        finally:
            stop_process(healthy)
        assert careful.devnet.balance(NETWORK, careful.payout) == 3_000_000
        final = w3.eth.get_transaction_receipt(row.tx_hash)
        assert final["status"] == 1 and w3.eth.block_number - final["blockNumber"] + 1 >= CONFIRMATIONS
        assert len(careful.events("payment.completed", intent_id)) == 1


def test_used_with_its_log_out_of_the_search_range_is_never_released(careful, chain):
    """authorizationState says used, but the log search (from the height the API read at /pay, which a
    lagging or load-balanced RPC may answer too high) does not find the transaction: still not unused."""
    intent = create_intent(careful.client, careful.shop, 1)
    intent_id = intent["intent_id"]
    payload = sign_authorization(careful.devnet.buyer(2).key, requirement(intent, NETWORK))
    assert pay(careful.client, careful.shop, intent, NETWORK, payload).status_code == 504  # no relayer
    w3, token = _token(careful.devnet, NETWORK)
    executed = _execute(w3, token, payload)  # anyone may submit it: an outsider does
    start_block = careful.settlement(intent_id).start_block
    executed_in = int(w3.eth.get_transaction_receipt(executed)["blockNumber"])  # type: ignore[arg-type]
    with_lag = executed_in + 6  # the search starts (5 blocks before it) just after the execution
    db.session.execute(update(Settlement).where(Settlement.intent_id == intent_id).values(start_block=with_lag))
    db.session.commit()
    chain.mine(timestamp=int(payload["validBefore"]) + EXPIRY_GRACE_SECONDS + 30)
    chain.mine(CONFIRMATIONS)  # all of it final

    counts = careful.reconcile_later()
    assert counts["finished"] == 0 and counts["waiting"] == 1 and counts["resent"] == 0
    row = careful.intent_row(intent_id)
    assert row.status == "pending" and row.settlement_id is not None  # the money moved: never released
    assert careful.events("payment.failed", intent_id) == []

    db.session.execute(update(Settlement).where(Settlement.intent_id == intent_id).values(start_block=start_block))
    db.session.commit()  # the log is found again (in the tests' terms: the RPC caught up)
    assert careful.reconcile_later(300)["finished"] == 1
    row = careful.intent_row(intent_id)
    assert row.status == "paid" and row.tx_hash == executed


def test_an_unused_authorization_is_released_only_once_a_final_block_is_past_its_validity(careful, chain):
    """Unused at the chain's head, whose clock is past validBefore + 60 s: that head may still be replaced
    (a reorg) by blocks from before validBefore that execute it. Released once that block is final."""
    intent = create_intent(careful.client, careful.shop, 1)
    intent_id = intent["intent_id"]
    payload = sign_authorization(careful.devnet.buyer(0).key, requirement(intent, NETWORK))
    assert pay(careful.client, careful.shop, intent, NETWORK, payload).status_code == 504  # nobody sends it
    chain.pause()
    chain.mine(timestamp=int(payload["validBefore"]) + EXPIRY_GRACE_SECONDS + 30)  # 1 block of 3 past it
    assert careful.reconcile_later()["finished"] == 0
    assert careful.intent_row(intent_id).settlement_id is not None
    chain.mine(CONFIRMATIONS - 1)  # now final
    assert careful.reconcile_later(300)["finished"] == 1
    settlement = careful.settlement(intent_id)
    assert settlement.status == "failed" and settlement.failure_code == "AUTHORIZATION_EXPIRED"
    assert careful.intent_row(intent_id).settlement_id is None
    assert careful.devnet.balance(NETWORK, careful.payout) == 0
