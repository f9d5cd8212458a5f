"""/pay's claim in Core statements (services.claim): an error between its INSERT and its conditional UPDATE
leaves nothing written, and the per-payer cap holds when one payer pays two merchants at once (two merchant
locks, one payer lock, both counts read under both)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eth_account import Account
from sqlalchemy import event, func, select

from backend.extensions import db
from backend.intents.models import Intent
from backend.settlement.models import Settlement
from payintent.eip3009 import sign_authorization
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_payer_code import capped, funded_buyer  # noqa: F401  (fixture)
from tests.settlement.test_recovery import NETWORK, _token

PAY_NETWORK = "eip155:84532"


def test_an_error_between_the_insert_and_the_conditional_update_leaves_nothing(pay_app, pay_client, shop, devnet):
    """The conditional UPDATE fails (a lost connection, a statement timeout): no settlement row, the intent
    untouched, and the same authorization then pays (its INSERT was not kept: no NONCE_ALREADY_USED)."""
    engine = db.engine
    intent = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, PAY_NETWORK))

    def fail_the_claim_update(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("UPDATE intents") and "settlement_id" in statement and "expires_at" in statement:
            raise RuntimeError("the connection dropped between INSERT and UPDATE")

    event.listen(engine, "before_cursor_execute", fail_the_claim_update)
    try:
        try:
            response = pay(pay_client, shop, intent, PAY_NETWORK, payload)
            assert response.status_code >= 500, response.get_json()
        except RuntimeError:
            pass
    finally:
        event.remove(engine, "before_cursor_execute", fail_the_claim_update)
    db.session.remove()
    assert db.session.scalar(select(func.count()).select_from(Settlement)) == 0
    row = db.session.get(Intent, intent["intent_id"])
    assert row is not None and row.status == "pending" and row.settlement_id is None
    again = pay(pay_client, shop, intent, PAY_NETWORK, payload)
    assert again.status_code == 200, again.get_json()
    assert devnet.balance(PAY_NETWORK, shop.payout) == 1_500_000


def test_concurrent_payments_of_one_payer_over_two_merchants_hold_the_cap(capped):  # noqa: F811
    """Cap 2 per payer; six /pay of one payer at once, to two merchants (two merchant locks, one payer lock):
    at most two are claimed, the rest PAYER_TOO_MANY_OPEN_PAYMENTS, no deadlock."""
    from tests.conftest import create_merchant

    w3, token = _token(capped.devnet, NETWORK)
    buyer = funded_buyer(w3, token, capped.devnet, 10_000_000)
    other = create_merchant(capped.app, f"other-{Account.create().address[-8:]}@example.com",
                            {n: Account.create().address for n in capped.devnet.networks})  # fmt: skip
    jobs = []
    for i in range(6):
        shop = capped.shop if i % 2 else other
        intent = create_intent(capped.client, shop, 1)
        jobs.append((shop, intent, sign_authorization(buyer.key, requirement(intent, NETWORK))))

    def attempt(job: Any) -> tuple[int, str]:
        shop, intent, payload = job
        with capped.app.test_client() as client:
            response = pay(client, shop, intent, NETWORK, payload)
            return response.status_code, (response.get_json().get("error") or {}).get("code", "OK")

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(attempt, jobs))
    claimed = [r for r in results if r[1] in ("OK", "SETTLEMENT_PENDING")]
    assert len(claimed) == 2, results
    assert all(code == "PAYER_TOO_MANY_OPEN_PAYMENTS" for _, code in results if (_, code) not in claimed), results
    db.session.remove()
    assert db.session.scalar(select(func.count()).select_from(Settlement).where(Settlement.payer == buyer.address)) == 2
