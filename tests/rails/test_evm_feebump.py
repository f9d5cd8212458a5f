"""A stuck relay transaction replaced at its nonce with higher fees, through the relayer's own settle flow on a real
Anvil (``relayer.tasks._settle`` in a thread of the test, with relay accounts of its own): the base fee is raised
above the transaction's maxFeePerGas block after block (``anvil_setNextBlockBaseFeePerGas``, mining by hand), so
the node holds it and never mines it. The settlement ends paid once whichever of the two is mined, and the fee cap
stops the bumps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
from eth_account import Account
from eth_account.signers.local import LocalAccount
from redis import Redis

from backend.extensions import db
from backend.rails.evm import accounts as accounts_module
from backend.rails.evm import feebump, pipeline, relay
from backend.settlement import services
from payintent.eip3009 import sign_authorization
from relayer import tasks
from relayer.worker import _in_app
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, iso

__all__ = ["iso"]


class Replaced(NamedTuple):
    intent_id: str
    settlement_id: str
    thread: threading.Thread
    first: str
    second: str
    old_raw: bytes
    nonce: int


class Stuck:
    """One test's relay account, the settle thread, and the chain's mining by hand."""

    def __init__(self, iso: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.iso = iso
        self.w3 = iso.devnet.w3(NETWORK)
        self.redis = Redis.from_url(iso.redis_url)
        self.relay: LocalAccount = Account.create()
        self.rpc("anvil_setBalance", self.relay.address, hex(10**20))
        keys = relay.EvmRelayKeys([self.relay])
        keys.use_recorded_nonces(_in_app(iso.app, services.max_relay_nonce))
        monkeypatch.setitem(tasks.RELAY_KEYS, NETWORK, keys)
        monkeypatch.setattr(relay, "FEE_CACHE_SECONDS", 0.0)  # the chain's fees read afresh at each look
        self.records: list[tuple[str, str, int | None]] = []
        real = services.mark_submitted

        def recording(
            settlement_id: str, tx_hash: str, address: str, *, relay_nonce: int | None, expect_tx: str | None = None
        ) -> bool:
            self.records.append((tx_hash, address, relay_nonce))
            return real(settlement_id, tx_hash, address, relay_nonce=relay_nonce, expect_tx=expect_tx)

        self.real_mark_submitted = real

        monkeypatch.setattr(services, "mark_submitted", recording)
        self.outcomes: list[str] = []

    def rpc(self, method: str, *params: Any) -> Any:
        response = self.w3.provider.make_request(method, list(params))
        assert "error" not in response, (method, response)
        return response["result"]

    def open_settlement(self, buyer: int, amount: float = 1) -> tuple[str, str]:
        """A paid-for intent whose settlement waits in the (private, unserved) relayer queue: (intent, settlement)."""
        intent = create_intent(self.iso.client, self.iso.shop, amount)
        payload = sign_authorization(self.iso.devnet.buyer(buyer).key, requirement(intent, NETWORK))
        assert pay(self.iso.client, self.iso.shop, intent, NETWORK, payload).status_code == 504  # nobody settles it
        return intent["intent_id"], self.iso.settlement(intent["intent_id"]).id

    def settle_in_thread(self, settlement_id: str) -> threading.Thread:
        def run() -> None:
            with self.iso.app.app_context():
                try:
                    self.outcomes.append(tasks._settle(settlement_id, self.redis))
                finally:
                    db.session.remove()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def mine(self, base_fee: int | None = None) -> None:
        if base_fee is not None:
            self.rpc("anvil_setNextBlockBaseFeePerGas", hex(base_fee))
        self.rpc("evm_mine")

    def mine_high_until(self, high: int, done: Callable[[], bool], blocks: int = 200) -> None:
        """Blocks whose base fee is ``high`` (above the transaction's fee cap), a little time apart, until ``done``."""
        for _ in range(blocks):
            if done():
                return
            self.mine(high)
            time.sleep(0.25)
        raise AssertionError("timed out")

    def replaced_then_dropped(self, buyer: int) -> Replaced:
        """A settlement whose first transaction was replaced (the base fee held above its cap) and whose replacement
        was then dropped by the node, the first's signed bytes kept: the caller decides what gets mined."""
        intent_id, settlement_id = self.open_settlement(buyer)
        self.rpc("evm_setAutomine", False)
        thread = self.settle_in_thread(settlement_id)
        until(lambda: self.records)
        first, _, nonce = self.records[0]
        assert nonce is not None
        old = self.pending(first)
        until(lambda: pipeline._watchers[NETWORK].raw_of(first) is not None)
        old_raw = pipeline._watchers[NETWORK].raw_of(first)
        assert old_raw is not None
        self.mine_high_until(old["maxFeePerGas"] * 3 // 2, lambda: len(self.records) > 1)
        second = self.records[1][0]
        self.pending(second)
        assert self.iso.settlement(intent_id).tx_hash == second
        self.rpc("anvil_dropTransaction", second)
        self.mine(1)  # the fees fall (a node refuses a fee cap below the base fee)
        return Replaced(intent_id, settlement_id, thread, first, second, old_raw, nonce)

    def pending(self, tx_hash: str) -> dict[str, Any]:
        until(lambda: _known(self.w3, tx_hash))
        tx = self.w3.eth.get_transaction(tx_hash)
        assert tx["blockNumber"] is None
        return dict(tx)


def _known(w3: Any, tx_hash: str) -> bool:
    try:
        w3.eth.get_transaction(tx_hash)
        return True
    except Exception:
        return False


def until(condition: Callable[[], Any], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def stuck(iso: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stuck]:
    monkeypatch.setattr(tasks, "RECEIPT_TIMEOUT_SECONDS", 60)
    # Anvil drops a pending transaction once the base fee passes its fee cap (geth keeps it, waiting) and refuses
    # its bytes again; the repair step would then fill its nonce with a cancel, racing the replacement: off here.
    monkeypatch.setattr(accounts_module, "REPAIR_SECONDS", 3600.0)
    _reset()
    control = Stuck(iso, monkeypatch)
    try:
        yield control
    finally:
        control.rpc("evm_setAutomine", True)
        _reset()


def _reset() -> None:
    """Fresh process-wide watchers and account pools, as a new relayer process has."""
    for watcher in pipeline._watchers.values():
        watcher.stop()
    pipeline._watchers.clear()
    for pool in accounts_module._pools.values():
        pool.release()
    accounts_module._pools.clear()


def _paid_once(stuck: Stuck, intent_id: str, tx_hash: str, payout_before: int, amount: int) -> None:
    settlement = stuck.iso.settlement(intent_id)
    assert (settlement.status, settlement.tx_hash) == ("confirmed", tx_hash)
    assert stuck.iso.intent_row(intent_id).status == "paid"
    assert len(stuck.iso.completed_events(intent_id)) == 1
    assert stuck.iso.devnet.balance(NETWORK, stuck.iso.payout) - payout_before == amount  # moved once, on chain
    assert stuck.w3.eth.get_transaction_receipt(tx_hash)["status"] == 1


def test_a_stuck_transaction_is_replaced_with_higher_fees_and_the_account_goes_on(stuck: Stuck) -> None:
    intent_id, settlement_id = stuck.open_settlement(0)
    stuck.rpc("evm_setAutomine", False)
    thread = stuck.settle_in_thread(settlement_id)
    until(lambda: stuck.records)
    first, address, nonce = stuck.records[0]
    old = stuck.pending(first)
    # The fees rise past what it was signed with (its maxFeePerGas below every new block's base fee): held, not mined.
    high = old["maxFeePerGas"] * 3 // 2
    stuck.mine_high_until(high, lambda: len(stuck.records) > 1)
    second, address2, nonce2 = stuck.records[1]
    assert (address2, nonce2) == (address, nonce) == (stuck.relay.address, nonce)  # the same (account, nonce)
    new = stuck.pending(second)
    assert new["nonce"] == nonce
    assert new["maxFeePerGas"] >= -(-old["maxFeePerGas"] * 9 // 8) and new["maxFeePerGas"] > high
    assert new["maxPriorityFeePerGas"] >= -(-old["maxPriorityFeePerGas"] * 9 // 8)
    assert stuck.iso.settlement(intent_id).tx_hash == second  # recorded before its broadcast
    stuck.mine()  # the base fee falls back a little, still above the old fee cap: only the replacement fits
    thread.join(timeout=60)
    assert stuck.outcomes == ["confirmed"]
    _paid_once(stuck, intent_id, second, 0, 1_000_000)
    assert stuck.w3.eth.get_transaction_count(stuck.relay.address, "latest") == nonce + 1
    assert len(stuck.records) == 2
    # The account is not stalled: the next payment goes at the next nonce and is paid.
    stuck.rpc("evm_setAutomine", True)
    intent2, settlement2 = stuck.open_settlement(1, 2)
    stuck.settle_in_thread(settlement2).join(timeout=60)
    assert stuck.outcomes == ["confirmed", "confirmed"]
    assert stuck.records[2][1:] == (stuck.relay.address, nonce + 1)
    _paid_once(stuck, intent2, stuck.records[2][0], 1_000_000, 2_000_000)


def test_the_replaced_transaction_mined_after_all_still_pays_the_settlement_once(stuck: Stuck) -> None:
    intent_id, _, thread, first, _, old_raw, nonce = stuck.replaced_then_dropped(2)
    stuck.w3.eth.send_raw_transaction(old_raw)
    stuck.mine(1)
    assert stuck.w3.eth.get_transaction_receipt(first)["status"] == 1
    thread.join(timeout=60)
    assert stuck.outcomes == ["confirmed"]
    _paid_once(stuck, intent_id, first, 0, 1_000_000)
    assert stuck.w3.eth.get_transaction_count(stuck.relay.address, "latest") == nonce + 1


def test_fees_at_the_cap_are_not_bumped_further(
    stuck: Stuck, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the cap at 2 x the first fee cap, the replacement is signed at the cap; when the fees rise past it too,
    it is left as it is, loudly, however many heads go by (no third transaction); it is mined once they fall."""
    monkeypatch.setenv(feebump.MAX_FEE_MULTIPLE_ENV, "2")
    intent_id, settlement_id = stuck.open_settlement(0)
    stuck.rpc("evm_setAutomine", False)
    thread = stuck.settle_in_thread(settlement_id)
    until(lambda: stuck.records)
    first = stuck.records[0][0]
    old = stuck.pending(first)
    stuck.mine_high_until(old["maxFeePerGas"] * 3 // 2, lambda: len(stuck.records) > 1)
    second = stuck.records[1][0]
    assert stuck.pending(second)["maxFeePerGas"] == 2 * old["maxFeePerGas"]  # the market asks more: capped
    watcher = pipeline._watchers[NETWORK]
    raw = watcher.raw_of(second)
    assert raw is not None
    with caplog.at_level(logging.ERROR, logger=feebump.__name__):
        above_the_cap = 3 * old["maxFeePerGas"]
        stuck.mine_high_until(above_the_cap, lambda: "fee cap" in caplog.text)
        for _ in range(4 * feebump.DEFAULT_REPLACE_AFTER):  # many more heads at fees above the cap: no third
            stuck.mine(above_the_cap)
            time.sleep(0.25)
    assert [tx for tx, _, _ in stuck.records] == [first, second]
    stuck.mine(1)  # the fees fall
    if not _known(stuck.w3, second):  # Anvil dropped it while the base fee was above its fee cap (geth keeps it)
        stuck.w3.eth.send_raw_transaction(raw)
    stuck.mine(1)
    thread.join(timeout=60)
    assert stuck.outcomes == ["confirmed"]
    _paid_once(stuck, intent_id, second, 0, 1_000_000)


_TRANSFER_ABI = [{"type": "function", "name": "transfer", "stateMutability": "nonpayable",
                  "inputs": [{"name": "to", "type": "address"}, {"name": "value", "type": "uint256"}],
                  "outputs": [{"name": "", "type": "bool"}]}]  # fmt: skip


def _move_tokens(stuck: Stuck, sender_account: LocalAccount, to: str, amount: int) -> None:
    """An ERC-20 transfer by ``sender_account`` (mined by the caller: automine is off)."""
    token = stuck.w3.eth.contract(address=stuck.iso.devnet.info["networks"][NETWORK]["usdc_address"],
                                  abi=_TRANSFER_ABI)  # fmt: skip
    tx = token.functions.transfer(to, amount).build_transaction({
        "from": sender_account.address, "nonce": stuck.w3.eth.get_transaction_count(sender_account.address, "pending"),
        "gas": 100_000, "maxFeePerGas": 10**10, "maxPriorityFeePerGas": 1,
    })  # fmt: skip
    stuck.w3.eth.send_raw_transaction(sender_account.sign_transaction(tx).raw_transaction)


def _relay_spends(stuck: Stuck) -> list[tuple[str, int]]:
    from backend.relaybudget.models import RelaySpend

    with stuck.iso.app.app_context():
        try:
            return [(s.reference.lower(), int(s.amount_atomic)) for s in db.session.query(RelaySpend).all()]
        finally:
            db.session.remove()


def test_the_replaced_transaction_mined_and_reverted_is_the_one_the_row_names(stuck: Stuck) -> None:
    """The row names the replacement; the replaced one is mined and reverts (the payer's tokens moved away): the row
    is re-pointed at the mined one before the revert is decided (its finality wait reads the row's hash), and its
    gas is charged once, for it."""
    buyer = stuck.iso.devnet.buyer(2)
    intent_id, _, thread, first, _, old_raw, nonce = stuck.replaced_then_dropped(2)
    sink: LocalAccount = Account.create()
    stuck.rpc("anvil_setBalance", sink.address, hex(10**18))
    stuck.rpc("anvil_setBalance", buyer.address, hex(10**18))
    held = stuck.iso.devnet.balance(NETWORK, buyer.address)
    _move_tokens(stuck, buyer, sink.address, held)  # the authorization can only revert now
    stuck.mine(1)
    stuck.w3.eth.send_raw_transaction(old_raw)
    stuck.mine(1)
    assert stuck.w3.eth.get_transaction_receipt(first)["status"] == 0
    thread.join(timeout=60)
    try:
        assert stuck.outcomes == ["reverted"]
        row = stuck.iso.settlement(intent_id)
        assert (row.status, row.tx_hash.lower(), row.relay_nonce) == ("failed", first.lower(), nonce)
        assert [ref for ref, _ in _relay_spends(stuck)] == [first.lower()]  # charged once, for the mined one
        assert stuck.iso.devnet.balance(NETWORK, stuck.iso.payout) == 0
    finally:
        _move_tokens(stuck, sink, buyer.address, held)
        stuck.mine(1)


def test_the_replaced_transaction_mined_is_charged_once_and_named(stuck: Stuck) -> None:
    """As the test above it, but the replaced one succeeds: the row, the event and the relay spend name it."""
    intent_id, _, thread, first, _, old_raw, _ = stuck.replaced_then_dropped(1)
    stuck.w3.eth.send_raw_transaction(old_raw)
    stuck.mine(1)
    thread.join(timeout=60)
    assert stuck.outcomes == ["confirmed"]
    _paid_once(stuck, intent_id, first, 0, 1_000_000)
    assert [ref for ref, _ in _relay_spends(stuck)] == [first.lower()]


@pytest.mark.parametrize("node_lags", [False, True])
def test_a_cancel_taking_the_nonce_ends_the_wait_and_the_retry_pays_once(
    iso: Any, monkeypatch: pytest.MonkeyPatch, node_lags: bool
) -> None:
    """The repair step on (as in production): the node drops the stuck transaction (Anvil, base fee above its fee
    cap) and the repair step fills its nonce with a cancel. The job stops bumping (at most one replacement
    recorded, the row never left on a hash that was not broadcast), ends well before its receipt timeout, and the
    settlement's retry (the reconciler's) sends it at a new nonce: paid once. ``node_lags``: the job's read of the
    account's mined count misses the cancel (a node behind), so the replacement is recorded, refused "nonce too
    low", and the row put back on the transaction really broadcast."""
    monkeypatch.setattr(tasks, "RECEIPT_TIMEOUT_SECONDS", 60)
    monkeypatch.setattr(accounts_module, "REPAIR_SECONDS", 0.5)
    monkeypatch.setenv(feebump.REPLACE_AFTER_ENV, "8")  # the cancel most likely first (either order is handled)
    lag = {"on": node_lags}
    real_look = feebump._look
    monkeypatch.setattr(feebump, "_look", lambda *a: (False, real_look(*a)[1]) if lag["on"] else real_look(*a))
    _reset()
    stuck = Stuck(iso, monkeypatch)
    try:
        intent_id, settlement_id = stuck.open_settlement(0)
        payout_before = stuck.iso.devnet.balance(NETWORK, stuck.iso.payout)
        stuck.rpc("evm_setAutomine", False)
        started = time.monotonic()
        thread = stuck.settle_in_thread(settlement_id)
        until(lambda: stuck.records)
        first, _, nonce = stuck.records[0]
        high = stuck.pending(first)["maxFeePerGas"] * 3 // 2
        for _ in range(160):  # up to ~40 s of blocks above its fee cap, until the job ends
            if not thread.is_alive():
                break
            stuck.mine(high)
            time.sleep(0.25)
        thread.join(timeout=5)
        assert not thread.is_alive() and time.monotonic() - started < 40  # not waited out to the 60 s timeout
        assert stuck.w3.eth.get_transaction_count(stuck.relay.address, "latest") > nonce
        assert len({tx for tx, _, _ in stuck.records}) <= 2  # at most one replacement recorded
        if stuck.outcomes != ["confirmed"]:  # the cancel won (the likely case)
            assert stuck.outcomes == ["waiting-for-receipt"]
            row = stuck.iso.settlement(intent_id)
            assert row.status == "submitted" and row.relay_nonce == nonce
            broadcast = {tx.lower() for tx, _, _ in stuck.records[:1]} | {
                tx.lower() for tx, _, _ in stuck.records[1:] if _known(stuck.w3, tx)}  # fmt: skip
            assert row.tx_hash.lower() in broadcast
            if node_lags:  # the replacement recorded, refused, the row put back on the first: nothing more
                assert [tx for tx, _, _ in stuck.records] == [first, stuck.records[1][0], first]
            lag["on"] = False
            stuck.rpc("evm_setAutomine", True)
            stuck.settle_in_thread(settlement_id).join(timeout=60)  # the reconciler's retry
            assert stuck.outcomes[-1] == "confirmed"
            assert stuck.records[-1][2] is not None and stuck.records[-1][2] > nonce  # a new nonce
        row = stuck.iso.settlement(intent_id)
        _paid_once(stuck, intent_id, row.tx_hash, payout_before, 1_000_000)
    finally:
        stuck.rpc("evm_setAutomine", True)
        _reset()


def test_bad_fee_bump_settings_fall_back_loudly_and_the_cap_is_integer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from fractions import Fraction

    for bad in ("abc", "0", "-2", "1.5"):
        monkeypatch.setenv(feebump.REPLACE_AFTER_ENV, bad)
        assert feebump.replace_after() == feebump.DEFAULT_REPLACE_AFTER
    monkeypatch.setenv(feebump.REPLACE_AFTER_ENV, "5")
    assert feebump.replace_after() == 5
    for bad in ("inf", "nan", "0", "-1", "1", "x", "1e9"):
        monkeypatch.setenv(feebump.MAX_FEE_MULTIPLE_ENV, bad)
        with caplog.at_level(logging.ERROR, logger=feebump.__name__):
            assert feebump.max_fee_multiple() == feebump.DEFAULT_MAX_FEE_MULTIPLE
        assert feebump.MAX_FEE_MULTIPLE_ENV in caplog.text
    monkeypatch.setenv(feebump.MAX_FEE_MULTIPLE_ENV, "2.5")
    multiple = feebump.max_fee_multiple()
    assert multiple == Fraction(5, 2)
    first = 2**60 + 1  # exact past a float's 53 bits
    assert first * multiple.numerator // multiple.denominator == (5 * first) // 2


def test_no_replacement_past_the_authorizations_valid_before(
    stuck: Stuck, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the chain's time passes validBefore the transfer can only revert: it is not replaced (no second record,
    however far the fees rise), the job waits its timeout as for any transaction it does not replace."""
    monkeypatch.setattr(tasks, "RECEIPT_TIMEOUT_SECONDS", 10)
    chain_now = int(stuck.w3.eth.get_block("latest")["timestamp"])
    intent = create_intent(stuck.iso.client, stuck.iso.shop, 1)
    payload = sign_authorization(stuck.iso.devnet.buyer(1).key, requirement(intent, NETWORK), now=chain_now,
                                 valid_for=45)  # fmt: skip
    assert pay(stuck.iso.client, stuck.iso.shop, intent, NETWORK, payload).status_code == 504
    settlement_id = stuck.iso.settlement(intent["intent_id"]).id
    stuck.rpc("evm_setAutomine", False)
    with caplog.at_level(logging.WARNING, logger=feebump.__name__):
        thread = stuck.settle_in_thread(settlement_id)
        until(lambda: stuck.records)
        first = stuck.records[0][0]
        high = stuck.pending(first)["maxFeePerGas"] * 3 // 2
        stuck.rpc("evm_setNextBlockTimestamp", hex(int(payload["validBefore"]) + 1))
        stuck.mine_high_until(high, lambda: "validBefore" in caplog.text)
        for _ in range(2 * feebump.DEFAULT_REPLACE_AFTER):  # more heads above its fee cap: still no replacement
            stuck.mine(high)
            time.sleep(0.25)
        thread.join(timeout=30)
    assert [tx for tx, _, _ in stuck.records] == [first]
    assert stuck.outcomes == ["waiting-for-receipt"]
