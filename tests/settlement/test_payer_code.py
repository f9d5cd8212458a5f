"""A payer with contract code cannot make the relay pay for transactions that revert (hostile review, HIGH).

EIP-3009 on a payer address with code (an ERC-1271 smart wallet, or an EOA with an EIP-7702 delegation)
is checked by calling the payer's code: the token's ``SignatureChecker`` asks ``isValidSignature`` of it
(TestUSDC, like USDC v2.2). That code may answer one way when the relay estimates (``eth_estimateGas``
runs at gas price 0) and another when the transaction is mined, or burn gas: the relay pays the gas of
every reverted transaction and the intent is held meanwhile. Payers with code are refused at /pay and
again by the relayer right before it sends; the relay's transaction has a fixed gas limit; the estimate
uses the send's fee fields; a node's final refusal ends the settlement instead of retrying it.

Real Anvil chain, real TestUSDC, real relayer processes; the relay's spending read on chain.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from eth_account import Account
from redis import Redis
from sqlalchemy import select

from backend.chains.evm import evm_chain
from backend.events.models import Event
from backend.extensions import db
from backend.rails.evm import relay as evm
from backend.rails.evm.rail import EVM_RAIL
from backend.rails.evm.relay import EVM_SETTLEMENT_GAS
from backend.settlement.models import Settlement
from payintent.eip3009 import sign_authorization
from tests.settlement.conftest import stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, _send_as, _token, iso  # noqa: F401  (fixture)

MAGIC = bytes.fromhex("1626ba7e") + bytes(28)  # ERC-1271 isValidSignature's "valid" answer, as a word


def _push(value: int) -> bytes:
    size = max(1, (value.bit_length() + 7) // 8)
    return bytes([0x5F + size]) + value.to_bytes(size, "big")


def two_faced_wallet(burn_iterations: int = 0) -> bytes:
    """Runtime code answering ERC-1271 "valid" when the gas price is 0 (``eth_call``, ``eth_estimateGas``
    without fee fields), after burning ``burn_iterations`` loop turns (~26 gas each) so the estimate is
    as high as it likes; at any real gas price it hits INVALID, which burns all the gas it was given."""
    code = bytearray([0x3A, 0x15])  # GASPRICE ISZERO
    ok = 2 + 2 + 1 + 1 + 1  # PUSH1 ok, JUMPI, INVALID, STOP: the JUMPDEST after them
    code += bytes([0x60, ok, 0x57, 0xFE, 0x00, 0x5B])
    if burn_iterations:
        code += _push(burn_iterations)
        loop = len(code)
        code += bytes([0x5B, 0x60, 0x01, 0x90, 0x03, 0x80, 0x60, loop, 0x57, 0x50])  # c-=1 while c != 0; POP
    code += bytes([0x7F]) + MAGIC + bytes([0x60, 0x00, 0x52, 0x60, 0x20, 0x60, 0x00, 0xF3])  # return MAGIC
    return bytes(code)


def set_code(w3: Any, address: str, code: bytes) -> None:
    assert "error" not in w3.provider.make_request("anvil_setCode", [address, "0x" + code.hex()])


def delegation(target: str) -> bytes:
    """An EIP-7702 delegation designator: the code an EOA carries once it delegated to ``target``."""
    return bytes.fromhex("ef0100") + bytes.fromhex(target[2:])


def funded_buyer(w3: Any, token: Any, devnet: Any, amount: int) -> Any:
    buyer = Account.create()
    _send_as(w3, devnet.buyer(1), token.functions.transfer(buyer.address, amount))
    return buyer


def relay_addresses(devnet: Any) -> list[str]:
    with open(devnet.info["relay_keys_file"]) as keys:
        return [Account.from_key(key).address for key in json.load(keys)[NETWORK]]


def relay_nonces(w3: Any, devnet: Any) -> dict[str, int]:
    """How many transactions each relay account has sent (mined or pending): what the relay paid gas for."""
    return {address: w3.eth.get_transaction_count(address, "pending") for address in relay_addresses(devnet)}


def events(kind: str, intent_id: str) -> list[dict[str, Any]]:
    db.session.expire_all()
    rows = db.session.scalars(select(Event).where(Event.type == kind, Event.intent_id == intent_id))
    return [json.loads(row.payload)["data"] for row in rows]


def settlement_of(intent_id: str) -> Settlement:
    db.session.expire_all()
    return db.session.scalars(select(Settlement).where(Settlement.intent_id == intent_id)).one()


@pytest.mark.parametrize("kind", ["contract", "7702-delegation"])
def test_pay_refuses_a_payer_with_code_and_the_relay_sends_nothing(iso, kind):  # noqa: F811
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 3_000_000)
    wallet = Account.create().address
    set_code(w3, wallet, two_faced_wallet(burn_iterations=150_000))  # an estimate of ~4M gas
    set_code(w3, buyer.address, two_faced_wallet(150_000) if kind == "contract" else delegation(wallet))
    intent = create_intent(iso.client, iso.shop, 3)
    before = relay_nonces(w3, iso.devnet)
    relayer = iso.relayer()
    try:
        response = pay(
            iso.client, iso.shop, intent, NETWORK, sign_authorization(buyer.key, requirement(intent, NETWORK))
        )
    finally:
        stop_process(relayer)
    assert response.status_code == 400, response.get_json()
    assert response.get_json()["error"]["code"] == "PAYER_HAS_CODE"
    assert relay_nonces(w3, iso.devnet) == before  # the relay sent (and paid for) nothing
    assert iso.devnet.balance(NETWORK, buyer.address) == 3_000_000
    row = iso.intent_row(intent["intent_id"])
    assert row.status == "pending" and row.settlement_id is None  # payable with another wallet
    assert [e["code"] for e in events("payment.failed", intent["intent_id"])] == ["PAYER_HAS_CODE"]


def test_the_checkout_refuses_a_payer_with_code(iso):  # noqa: F811
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 1_000_000)
    set_code(w3, buyer.address, delegation(Account.create().address))
    intent = create_intent(iso.client, iso.shop, 1)
    body = {"payment_signature": {"scheme": "exact", "network": NETWORK, "x402Version": 1,
                                  "payload": sign_authorization(buyer.key, requirement(intent, NETWORK))}}  # fmt: skip
    response = iso.client.post(f"/api/v1/checkout/intents/{intent['intent_id']}/pay", json=body)
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "PAYER_HAS_CODE"


def test_code_that_appears_after_the_claim_is_refused_by_the_relayer_before_it_sends(iso):  # noqa: F811
    """The payer delegates (EIP-7702) after /pay accepted: the relayer looks again right before sending."""
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 2_000_000)
    intent = create_intent(iso.client, iso.shop, 2)
    intent_id = intent["intent_id"]
    payload = sign_authorization(buyer.key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504  # claimed; no relayer yet
    wallet = Account.create().address
    set_code(w3, wallet, two_faced_wallet(burn_iterations=150_000))
    set_code(w3, buyer.address, delegation(wallet))
    before = relay_nonces(w3, iso.devnet)
    relayer = iso.relayer()
    try:
        deadline = time.monotonic() + 60
        while settlement_of(intent_id).status != "failed":
            assert time.monotonic() < deadline, f"settlement is {settlement_of(intent_id).status}"
            time.sleep(0.1)
    finally:
        stop_process(relayer)
    settlement = settlement_of(intent_id)
    assert settlement.failure_code == "PAYER_HAS_CODE" and settlement.tx_hash is None
    assert relay_nonces(w3, iso.devnet) == before  # nothing sent, no gas paid
    assert iso.devnet.balance(NETWORK, buyer.address) == 2_000_000
    row = iso.intent_row(intent_id)
    assert row.status == "pending" and row.settlement_id is None  # released: payable with another wallet
    (failed,) = events("payment.failed", intent_id)
    assert failed["code"] == "PAYER_HAS_CODE" and failed["settlement_id"] == settlement.id
    assert settlement.watched_at is not None  # its signature is out: the watch still records a late execution


def _relay_call(iso: Any, buyer: Any, intent: dict[str, Any]) -> tuple[Any, Any]:  # noqa: F811
    chain = evm_chain(iso.devnet.chains.get(NETWORK))
    auth = sign_authorization(buyer.key, requirement(intent, NETWORK))
    terms = EVM_RAIL.terms_from_columns(
        {"payer": auth["from"], "pay_to": auth["to"], "amount_atomic": int(auth["value"]),
         "valid_after": int(auth["validAfter"]), "valid_before": int(auth["validBefore"]), "nonce": auth["nonce"],
         "signature": auth["signature"]}
    )  # fmt: skip
    return chain, evm.transfer_call(chain, terms)


def test_the_estimate_uses_the_sends_fee_fields(iso):  # noqa: F811
    """At gas price 0 the two-faced wallet says "valid"; at the send's fees it reverts: the estimate must see that."""
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 1_000_000)
    intent = create_intent(iso.client, iso.shop, 1)
    chain, call = _relay_call(iso, buyer, intent)
    set_code(w3, buyer.address, two_faced_wallet())
    with pytest.raises(evm.Reverted):
        evm.estimate(chain, call, relay_addresses(iso.devnet)[0], evm.fees(chain))


def test_an_estimate_above_the_gas_cap_is_a_revert_not_a_retry(iso):  # noqa: F811
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 1_000_000)
    intent = create_intent(iso.client, iso.shop, 1)
    chain, call = _relay_call(iso, buyer, intent)
    wallet = Account.create().address
    set_code(w3, wallet, two_faced_wallet(burn_iterations=150_000))
    set_code(w3, buyer.address, delegation(wallet))
    # Even at gas price 0 (where the wallet says "valid") it needs millions of gas: more than the cap.
    with pytest.raises(evm.Reverted):
        evm.estimate(chain, call, relay_addresses(iso.devnet)[0], {"maxFeePerGas": 0, "maxPriorityFeePerGas": 0})


def test_code_that_appears_at_the_last_moment_costs_the_relay_at_most_the_gas_cap(iso):  # noqa: F811
    """Code set between the relayer's last look and the broadcast (here: in the broadcast hook) makes the
    transaction revert; the fixed gas limit bounds what it burns, whatever the estimate said."""
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 1_000_000)
    intent = create_intent(iso.client, iso.shop, 1)
    chain, call = _relay_call(iso, buyer, intent)
    relay = Account.from_key(json.load(open(iso.devnet.info["relay_keys_file"]))[NETWORK][0])  # noqa: SIM115
    fees = evm.fees(chain)
    assert evm.estimate(chain, call, relay.address, fees) < EVM_SETTLEMENT_GAS  # no code yet: an honest estimate
    wallet = Account.create().address
    set_code(w3, wallet, two_faced_wallet(burn_iterations=150_000))
    tx_hash = evm.send(
        Redis.from_url(iso.redis_url), chain, [relay], call, fees,
        before_broadcast=lambda _h, _a, _n: set_code(w3, buyer.address, delegation(wallet)),
    )  # fmt: skip
    receipt = w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30)
    assert receipt["status"] == 0  # the payer's code made it revert
    assert w3.eth.get_transaction(tx_hash)["gas"] == EVM_SETTLEMENT_GAS
    assert receipt["gasUsed"] <= EVM_SETTLEMENT_GAS
    assert iso.devnet.balance(NETWORK, buyer.address) == 1_000_000


def test_the_relay_transaction_has_the_fixed_gas_limit(iso):  # noqa: F811
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 1_000_000)
    intent = create_intent(iso.client, iso.shop, 1)
    relayer = iso.relayer()
    try:
        pay(iso.client, iso.shop, intent, NETWORK, sign_authorization(buyer.key, requirement(intent, NETWORK)))
        paid = iso.wait_paid(intent["intent_id"], timeout=60)
    finally:
        stop_process(relayer)
    assert w3.eth.get_transaction(paid.tx_hash)["gas"] == EVM_SETTLEMENT_GAS
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000


@pytest.fixture
def capped(db_url: str, redis_server_url: str, devnet: Any) -> Any:
    """``iso`` with at most two open payments per payer."""
    import uuid

    from tests.settlement.conftest import make_pay_app
    from tests.settlement.test_recovery import Isolated

    queue = f"relayer-test-{uuid.uuid4().hex[:8]}"
    app = make_pay_app(db_url, redis_server_url, devnet, relayer_queue=queue, pay_wait_seconds=1,
                       max_open_settlements_per_payer=2)  # fmt: skip
    with app.app_context():
        yield Isolated(app, queue, db_url, redis_server_url, devnet)
        db.session.remove()
        db.engine.dispose()


def test_one_payer_cannot_hold_more_than_the_cap_of_intents_at_once(capped):
    from tests.conftest import create_merchant

    w3, token = _token(capped.devnet, NETWORK)
    buyer = funded_buyer(w3, token, capped.devnet, 10_000_000)
    other_shop = create_merchant(capped.app, f"other-{Account.create().address[-8:]}@example.com",
                                 {n: Account.create().address for n in capped.devnet.networks})  # fmt: skip
    held = [create_intent(capped.client, capped.shop, 1), create_intent(capped.client, capped.shop, 1)]
    for intent in held:  # claimed and left open: no relayer runs yet
        payload = sign_authorization(buyer.key, requirement(intent, NETWORK))
        assert pay(capped.client, capped.shop, intent, NETWORK, payload).status_code == 504
    third = create_intent(capped.client, other_shop, 1)  # another merchant: the cap is the payer's
    response = pay(
        capped.client, other_shop, third, NETWORK, sign_authorization(buyer.key, requirement(third, NETWORK))
    )
    assert response.status_code == 429, response.get_json()
    assert response.get_json()["error"]["code"] == "PAYER_TOO_MANY_OPEN_PAYMENTS"
    assert response.headers["Retry-After"] == "30"
    row = capped.intent_row(third["intent_id"])
    assert row.settlement_id is None and row.status == "pending"  # nothing claimed, nothing sent
    assert iso_balance(capped, buyer) == 10_000_000

    relayer = capped.relayer()
    try:
        for intent in held:
            capped.wait_paid(intent["intent_id"], timeout=60)
        # Once they finished, the payer may pay again.
        response = pay(capped.client, other_shop, third, NETWORK,
                       sign_authorization(buyer.key, requirement(third, NETWORK)))  # fmt: skip
        assert response.status_code in (200, 504), response.get_json()
        capped.wait_paid(third["intent_id"], timeout=60)
    finally:
        stop_process(relayer)
    assert iso_balance(capped, buyer) == 7_000_000


def iso_balance(iso: Any, buyer: Any) -> int:  # noqa: F811
    return iso.devnet.balance(NETWORK, buyer.address)
