"""A settlement records the nonce its relay transaction was signed with (``settlements.relay_nonce``), before the
broadcast, through the real relayer on Anvil; the public API never shows it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from eth_account import Account
from redis import Redis

from backend.chains.evm import evm_chain
from backend.rails.evm import relay as evm
from backend.rails.evm.nonces import NonceManager
from backend.rails.evm.rail import EVM_RAIL
from backend.settlement import services
from payintent.eip3009 import sign_authorization
from relayer.faults import CRASH_EXIT_CODE
from tests.settlement.conftest import stop_process
from tests.settlement.test_pay import INTENTS, create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, iso

__all__ = ["iso"]


def test_a_paid_settlement_records_its_transactions_sender_and_nonce(iso: Any) -> None:
    intent = create_intent(iso.client, iso.shop, 2)
    payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK))
    relayer = iso.relayer()
    try:
        pay(iso.client, iso.shop, intent, NETWORK, payload)
        paid = iso.wait_paid(intent["intent_id"])
    finally:
        stop_process(relayer)
    settlement = iso.settlement(intent["intent_id"])
    tx = iso.devnet.w3(NETWORK).eth.get_transaction(paid.tx_hash)
    assert settlement.tx_hash == paid.tx_hash
    assert (settlement.relay_address, settlement.relay_nonce) == (tx["from"], tx["nonce"])
    assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000
    shown = iso.client.get(f"{INTENTS}/{intent['intent_id']}", headers=iso.shop.headers)
    assert shown.status_code == 200 and "relay_nonce" not in json.dumps(shown.get_json())


def test_the_nonce_is_recorded_before_the_broadcast_and_a_nonce_manager_starts_after_it(iso: Any) -> None:
    """The relayer dies between the record and the broadcast: the row holds the (account, nonce) it signed, the
    chain never saw it, and a nonce manager given the recorded nonce (Redis lost) starts after it and reports it as
    a gap."""
    intent = create_intent(iso.client, iso.shop, 1)
    payload = sign_authorization(iso.devnet.buyer(1).key, requirement(intent, NETWORK))
    crashing = iso.relayer(fault="after-mark-submitted")
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    settlement = iso.settlement(intent["intent_id"])
    assert settlement.status == "submitted" and settlement.relay_address and settlement.relay_nonce is not None
    w3 = iso.devnet.w3(NETWORK)
    assert w3.eth.get_transaction_count(settlement.relay_address, "pending") == settlement.relay_nonce  # not sent
    assert iso.devnet.balance(NETWORK, iso.payout) == 0
    redis = Redis.from_url(iso.redis_url)
    manager = NonceManager(w3, NETWORK, settlement.relay_address, w3.eth.chain_id, redis)
    redis.delete(manager.hint_key)  # Redis lost too: the database's record alone keeps the nonce from being reused
    assert manager.start(settlement.relay_nonce) == [settlement.relay_nonce]
    assert manager.allocate() == settlement.relay_nonce + 1


def test_a_send_tried_again_after_nonce_too_low_records_the_nonce_it_signed_last(
    iso: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``relay.send`` signs again at a new nonce after the node's "nonce too low" (here: a lagging node's pending
    count, once): ``before_broadcast`` runs again, so the open settlement's row names the mined transaction's
    (hash, sender, nonce), not the refused one's."""
    intent = create_intent(iso.client, iso.shop, 1)
    auth = sign_authorization(iso.devnet.buyer(2).key, requirement(intent, NETWORK))
    crashing = iso.relayer(fault="after-mark-submitted")  # an open (submitted) settlement, nothing sent
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, auth).status_code == 504
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    settlement = iso.settlement(intent["intent_id"])
    keys = json.load(open(iso.devnet.info["relay_keys_file"]))[NETWORK]  # noqa: SIM115
    relay = next(a for a in map(Account.from_key, keys) if a.address == settlement.relay_address)
    redis = Redis.from_url(iso.redis_url)
    redis.delete(evm.LEASE_KEY.format(NETWORK, relay.address))  # the dead relayer's lease
    chain = evm_chain(iso.devnet.chains.get(NETWORK))
    w3 = chain.w3
    # The settlement's recorded nonce goes to another transaction: the nonce a lagging node names is mined.
    lagging = int(w3.eth.get_transaction_count(relay.address, "pending"))
    tx = {"from": relay.address, "to": relay.address, "value": 0, "gas": 21_000, "nonce": lagging,
          "chainId": w3.eth.chain_id, **evm.fees(chain)}  # fmt: skip
    assert w3.eth.wait_for_transaction_receipt(w3.eth.send_raw_transaction(relay.sign_transaction(tx).raw_transaction))
    real_count, answers = w3.eth.get_transaction_count, [lagging]  # the next count read answers `lagging`, once
    monkeypatch.setattr(w3.eth, "get_transaction_count", lambda *a: answers.pop() if answers else real_count(*a))
    terms = EVM_RAIL.terms_from_columns(
        {"payer": auth["from"], "pay_to": auth["to"], "amount_atomic": int(auth["value"]),
         "valid_after": int(auth["validAfter"]), "valid_before": int(auth["validBefore"]), "nonce": auth["nonce"],
         "signature": auth["signature"]}
    )  # fmt: skip
    calls: list[tuple[str, str, int]] = []

    def recorded(tx_hash: str, address: str, nonce: int) -> None:
        calls.append((tx_hash, address, nonce))
        services.mark_submitted(settlement.id, tx_hash, address, relay_nonce=nonce)

    tx_hash = evm.send(redis, chain, [relay], evm.transfer_call(chain, terms), evm.fees(chain), recorded)
    assert w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30)["status"] == 1
    mined = w3.eth.get_transaction(tx_hash)
    assert calls == [(calls[0][0], relay.address, lagging), (tx_hash, relay.address, lagging + 1)]
    assert mined["nonce"] == lagging + 1
    row = iso.settlement(intent["intent_id"])
    assert (row.tx_hash, row.relay_address, row.relay_nonce) == (tx_hash, mined["from"], mined["nonce"])
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000


def test_a_relayer_restarted_after_a_crash_fills_the_gap_and_the_payment_and_later_ones_settle(iso: Any) -> None:
    """The relayer dies between the record and the broadcast; the next relayer process that owns the account starts
    its nonces after the recorded one (``services.max_relay_nonce``) and fills the gap, so the account does not
    stall: the crashed settlement is paid once, a later payment too. Which fills the gap depends on what leases the
    account first: adoption's start cancels it (the settlement is then sent at a later nonce), the settlement's own
    retry leases it with ``keep`` and sends its transfer there (accounts.AccountPool.lease)."""
    intent = create_intent(iso.client, iso.shop, 1)
    payload = sign_authorization(iso.devnet.buyer(1).key, requirement(intent, NETWORK))
    crashing = iso.relayer(fault="after-mark-submitted")
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    settlement = iso.settlement(intent["intent_id"])
    account, gap = settlement.relay_address, settlement.relay_nonce
    assert account and gap is not None
    assert services.max_relay_nonce(NETWORK, account.lower()) == gap
    redis = Redis.from_url(iso.redis_url)
    redis.delete(evm.LEASE_KEY.format(NETWORK, account))  # the dead process's lease, as if its 30 s had passed
    for address in EVM_RAIL.relay_accounts(iso.devnet.chains.get(NETWORK)):
        if address != account:  # the next relayer can only own the crashed one's account
            redis.set(evm.LEASE_KEY.format(NETWORK, address), b"another-process", ex=120)
    relayer = iso.relayer()
    try:
        iso.reconcile_later(120)
        paid = iso.wait_paid(intent["intent_id"])
        second = create_intent(iso.client, iso.shop, 1)
        pay(iso.client, iso.shop, second, NETWORK,
            sign_authorization(iso.devnet.buyer(1).key, requirement(second, NETWORK)))  # fmt: skip
        later = iso.wait_paid(second["intent_id"])
    finally:
        stop_process(relayer)
        for address in EVM_RAIL.relay_accounts(iso.devnet.chains.get(NETWORK)):
            if redis.get(evm.LEASE_KEY.format(NETWORK, address)) == b"another-process":
                redis.delete(evm.LEASE_KEY.format(NETWORK, address))
    w3 = iso.devnet.w3(NETWORK)
    at_gap = _tx_at(w3, account, gap)
    filled = w3.eth.get_transaction(at_gap)
    if at_gap.lower() != (paid.tx_hash or "").lower():  # adopted first: the gap is a cancel, the payment later
        assert filled["to"] == account and filled["value"] == 0
        paid_tx = w3.eth.get_transaction(paid.tx_hash)
        assert paid_tx["from"] == account and paid_tx["nonce"] > gap
    later_tx = w3.eth.get_transaction(later.tx_hash)
    assert later_tx["from"] == account and later_tx["nonce"] > gap
    assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000  # each paid once
    assert len(iso.completed_events(intent["intent_id"])) == 1


def _tx_at(w3: Any, address: str, nonce: int) -> str:
    head = int(w3.eth.block_number)
    for number in range(head, max(head - 200, -1), -1):
        for tx in w3.eth.get_block(number, full_transactions=True)["transactions"]:
            if tx["from"] == address and tx["nonce"] == nonce:
                return "0x" + bytes(tx["hash"]).hex()
    raise AssertionError(f"no transaction of {address} at nonce {nonce} in the last 200 blocks")


def test_two_open_settlements_never_record_the_same_relay_account_and_nonce(iso: Any) -> None:
    """The unique index over open rows (migration 0012): a second open settlement's record of an (account, nonce)
    another open one holds fails (``RelayNonceTaken``, nothing changed), whatever the case of the address's hex (the
    index is on lower(relay_address), as ``max_relay_nonce`` compares), its own replacement at its nonce records,
    and once the first is closed the nonce may be recorded again (a closed row keeps its nonce, unconstrained)."""
    import secrets
    from datetime import UTC, datetime

    from backend.extensions import db
    from backend.intents.models import Intent
    from backend.rails.base import RelayNonceTaken
    from backend.settlement.models import Settlement

    now = datetime.now(UTC)
    account = Account.create().address
    rows = []
    for _ in range(2):
        intent = db.session.get(Intent, create_intent(iso.client, iso.shop, 1)["intent_id"])
        assert intent is not None
        row = Settlement(id="stl_" + secrets.token_hex(16), intent_id=intent.id, merchant_id=intent.merchant_id,
                         network=NETWORK, asset=iso.devnet.info["networks"][NETWORK]["usdc_address"],
                         payer=Account.create().address, pay_to=iso.payout, amount_atomic=1, valid_after=0,
                         valid_before=2**40, nonce="0x" + secrets.token_hex(32), signature="0x" + "00" * 65,
                         status="pending", created_at=now, updated_at=now)  # fmt: skip
        db.session.add(row)
        rows.append(row.id)
    db.session.commit()
    first, second = rows
    services.mark_submitted(first, "0x" + "01" * 32, account, relay_nonce=7)
    services.mark_submitted(first, "0x" + "02" * 32, account, relay_nonce=7)  # its own replacement: same nonce
    # The fee bump's record and put-back (expect_tx): only while the row names that hash at that (account, nonce).
    h = {n: "0x" + n * 32 for n in ("01", "02", "06")}
    assert not services.mark_submitted(first, h["06"], account, relay_nonce=7, expect_tx=h["01"])  # same nonce, moved
    assert not services.mark_submitted(first, h["06"], account, relay_nonce=6, expect_tx=h["02"])  # another nonce
    assert not services.mark_submitted(first, h["06"], Account.create().address, relay_nonce=7, expect_tx=h["02"])
    assert services.mark_submitted(first, h["06"], account.lower(), relay_nonce=7, expect_tx=h["02"].upper())
    assert services.mark_submitted(first, h["02"], account, relay_nonce=7, expect_tx=h["06"])  # put back
    with pytest.raises(RelayNonceTaken):
        services.mark_submitted(second, "0x" + "03" * 32, account, relay_nonce=7)
    with pytest.raises(RelayNonceTaken):  # the same account written in lowercase hex: still the same account
        services.mark_submitted(second, "0x" + "03" * 32, account.lower(), relay_nonce=7)
    assert services.max_relay_nonce(NETWORK, account.lower()) == services.max_relay_nonce(NETWORK, account) == 7
    services.mark_submitted(second, "0x" + "04" * 32, account, relay_nonce=8)  # another nonce: fine
    db.session.expire_all()
    held = {
        s.id: (s.status, s.tx_hash, s.relay_nonce) for s in db.session.query(Settlement).filter(Settlement.id.in_(rows))
    }
    assert held == {first: ("submitted", "0x" + "02" * 32, 7), second: ("submitted", "0x" + "04" * 32, 8)}
    services.fail_settlement(first, "SETTLEMENT_FAILED", "test: closed")
    services.mark_submitted(second, "0x" + "05" * 32, account, relay_nonce=7)  # the closed row does not hold it


def test_the_highest_recorded_nonce_is_read_from_an_index(app: Any) -> None:
    """``max_relay_nonce`` runs at each account's start and, for every free account, at each adoption round
    (ADOPT_SECONDS): it read every settlement (a sequential scan on PostgreSQL, 190 ms at 300k rows); it reads the
    end of ix_settlements_relay_nonce (network, lower(relay_address), relay_nonce) instead (0.1 ms)."""
    from sqlalchemy import event

    from backend.extensions import db

    statements: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        statements.append((statement, parameters))

    with app.app_context():
        engine = db.engine
        event.listen(engine, "before_cursor_execute", capture)
        try:
            assert services.max_relay_nonce(NETWORK, "0x" + "Ab" * 20) is None
        finally:
            event.remove(engine, "before_cursor_execute", capture)
        ((statement, parameters),) = [s for s in statements if "relay_nonce" in s[0]]
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SET enable_seqscan = off")  # an empty table: any usable index is chosen
                rows = conn.exec_driver_sql("EXPLAIN " + statement, parameters)
            else:
                rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            plan = "\n".join(str(row[-1]) for row in rows)
    assert "ix_settlements_relay_nonce" in plan, plan


def test_a_relayer_stopped_cleanly_frees_its_relay_accounts_at_once(iso: Any) -> None:
    """SIGTERM: the relayer main gives its leases up on its way out (``accounts.release_all``), so another relayer
    (on any host) may take them at once, not LEASE_SECONDS later."""
    intent = create_intent(iso.client, iso.shop, 1)
    payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK))
    redis = Redis.from_url(iso.redis_url)
    relayer = iso.relayer()
    try:
        pay(iso.client, iso.shop, intent, NETWORK, payload)
        iso.wait_paid(intent["intent_id"])
        leased = list(redis.scan_iter(match=evm.LEASE_KEY.format(NETWORK, "*")))
        assert len(leased) == 1  # the account it paid from
    finally:
        stop_process(relayer)
    assert relayer.returncode == 0
    assert list(redis.scan_iter(match=evm.LEASE_KEY.format(NETWORK, "*"))) == []
