"""The public x402 client libraries pay our intents on the devnet, unchanged.

The signer is the library's own: PyPI ``x402`` (``x402ClientSync`` + ``register_exact_evm_client``)
and npm ``@x402/core`` + ``@x402/evm`` (``x402_sign.mjs`` beside this file, run with ``node``).
Each is handed OUR intent's payment requirement in the library's own PaymentRequired shape
(v1: our requirement with the network's v1 name; v2: ``amount`` = ``maxAmountRequired`` and the
resource at the top), and what it builds is posted to ``/pay`` exactly as its header would carry
it. Then: 200, the merchant's balance moved exactly once on chain, the intent is paid.

Library versions: v2 (CAIP-2 ``accepted``) signs on every eip155 chain; v1 only on chains with a
v1 name the library knows (PyPI: base-sepolia; npm: base-sepolia and sepolia; Arc has none).
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from x402 import x402ClientSync
from x402.http.utils import encode_payment_signature_header
from x402.mechanisms.evm.exact import register_exact_evm_client
from x402.schemas import PaymentRequired
from x402.schemas.v1 import PaymentRequiredV1

from payintent.eip3009 import sign_authorization
from tests.settlement.test_pay import INTENTS, PAY, create_intent, events, requirement
from tests.settlement.test_pay_solana import SOLANA, signed_payment, sol, sol_shop, usdc  # noqa: F401  (fixtures)
from tests.settlement.test_pay_solana import buyer as solana_buyer

SIGN_MJS = Path(__file__).with_name("x402_sign.mjs")
EVM_NETWORKS = ["eip155:84532", "eip155:11155111", "eip155:5042002"]
CHECKOUT_PAY = "/api/v1/checkout/intents/{}/pay"


# --- our requirement in the libraries' shapes ----------------------------------------------------


def v1_name(devnet: Any, network: str) -> str:
    name = devnet.chains.get(network).x402_v1_name
    assert name, f"{network} has no x402 v1 name"
    return name


def payment_required_v1(req: dict[str, Any], network_name: str) -> dict[str, Any]:
    """A v1 402 body: our requirement as published, under the network's v1 name."""
    return {"x402Version": 1, "error": "X-PAYMENT header is required", "accepts": [{**req, "network": network_name}]}


def payment_required_v2(req: dict[str, Any]) -> dict[str, Any]:
    """A v2 PaymentRequired: CAIP-2 network, ``amount`` instead of ``maxAmountRequired``, resource on top."""
    entry = {
        "scheme": req["scheme"],
        "network": req["network"],
        "amount": req["maxAmountRequired"],
        "asset": req["asset"],
        "payTo": req["payTo"],
        "maxTimeoutSeconds": req["maxTimeoutSeconds"],
        "extra": req["extra"],
    }
    resource = {"url": req["resource"], "description": req["description"], "mimeType": req["mimeType"]}
    return {"x402Version": 2, "error": "Payment required", "resource": resource, "accepts": [entry]}


# --- the libraries as signers ---------------------------------------------------------------------


def pypi_sign(account: Any, payment_required: dict[str, Any]) -> dict[str, Any]:
    """PyPI x402's client: the PaymentPayload as its X-PAYMENT / PAYMENT-SIGNATURE header carries it."""
    client = x402ClientSync()
    register_exact_evm_client(client, account)
    # Its default spend controls allow only the assets it knows (Circle's USDC): opt in to ours.
    client.set_spend_controls(
        {"allowed_assets": [{"network": a["network"], "asset": a["asset"]} for a in payment_required["accepts"]]}
    )
    model = PaymentRequiredV1 if payment_required["x402Version"] == 1 else PaymentRequired
    payload = client.create_payment_payload(model.model_validate(payment_required))
    return json.loads(base64.b64decode(encode_payment_signature_header(payload)))


def npm_sign(account: Any, payment_required: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """npm @x402/core + @x402/evm's client, through x402_sign.mjs: the header's JSON and its name."""
    request = {"paymentRequired": payment_required, "privateKey": account.key.to_0x_hex(), **extra}
    done = subprocess.run(
        ["node", str(SIGN_MJS)], input=json.dumps(request), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["header"] == ("X-PAYMENT" if payment_required["x402Version"] == 1 else "PAYMENT-SIGNATURE")
    return answer["payload"]


SIGNERS = {"pypi": pypi_sign, "npm": npm_sign}


def post_pay(client: Any, shop: Any, intent: dict[str, Any], payment: dict[str, Any], checkout: bool = False) -> Any:
    if checkout:
        return client.post(CHECKOUT_PAY.format(intent["intent_id"]), json={"payment_signature": payment})
    return client.post(PAY, json={"intent_id": intent["intent_id"], "payment_signature": payment}, headers=shop.headers)


def assert_paid_once(client: Any, shop: Any, devnet: Any, intent: dict[str, Any], network: str, response: Any) -> None:
    assert response.status_code == 200, response.data
    data = response.get_json()["data"]
    amount = int(requirement(intent, network)["maxAmountRequired"])
    assert data["network"] == network and data["intent_id"] == intent["intent_id"]
    assert devnet.w3(network).eth.get_transaction_receipt(data["tx_hash"])["status"] == 1
    assert devnet.balance(network, shop.payout) == amount
    read = client.get(f"{INTENTS}/{intent['intent_id']}", headers=shop.headers).get_json()["data"]
    assert read["status"] == "paid" and read["tx_hash"] == data["tx_hash"] and read["chain"] == network
    assert len(events("payment.completed")) == 1


# --- the libraries pay ----------------------------------------------------------------------------


@pytest.mark.parametrize("network", EVM_NETWORKS)
@pytest.mark.parametrize("library", ["pypi", "npm"])
def test_v2_payload_from_the_library_pays_on_every_evm_chain(pay_client, shop, devnet, library, network):
    account = devnet.buyer(0)
    intent = create_intent(pay_client, shop, 1.25)
    payment = SIGNERS[library](account, payment_required_v2(requirement(intent, network)))
    assert payment["x402Version"] == 2 and "scheme" not in payment and "network" not in payment
    assert set(payment["payload"]) == {"authorization", "signature"}
    assert payment["accepted"]["network"] == network
    buyer_before = devnet.balance(network, account.address)
    response = post_pay(pay_client, shop, intent, payment)
    assert_paid_once(pay_client, shop, devnet, intent, network, response)
    assert response.get_json()["data"]["buyer_address"] == account.address
    assert buyer_before - devnet.balance(network, account.address) == 1_250_000
    # The same library payload again, or a fresh one: ALREADY_PAID, nothing more moves.
    again = post_pay(pay_client, shop, intent, payment)
    assert again.status_code == 409 and again.get_json()["error"]["code"] == "ALREADY_PAID"
    fresh = SIGNERS[library](account, payment_required_v2(requirement(intent, network)))
    assert post_pay(pay_client, shop, intent, fresh).get_json()["error"]["code"] == "ALREADY_PAID"
    assert devnet.balance(network, shop.payout) == 1_250_000


@pytest.mark.parametrize(
    ("library", "network"),
    [("pypi", "eip155:84532"), ("npm", "eip155:84532"), ("npm", "eip155:11155111")],
)
def test_v1_payload_with_the_v1_network_name_pays(pay_client, shop, devnet, library, network):
    intent = create_intent(pay_client, shop, 2)
    name = v1_name(devnet, network)
    payment = SIGNERS[library](devnet.buyer(1), payment_required_v1(requirement(intent, network), name))
    assert payment["x402Version"] == 1 and payment["network"] == name and "authorization" in payment["payload"]
    assert_paid_once(pay_client, shop, devnet, intent, network, post_pay(pay_client, shop, intent, payment))


@pytest.mark.parametrize("library", ["pypi", "npm"])
def test_the_public_checkout_pay_takes_library_payloads_too(pay_client, shop, devnet, library):
    network = "eip155:5042002"
    intent = create_intent(pay_client, shop, 0.5)
    payment = SIGNERS[library](devnet.buyer(2), payment_required_v2(requirement(intent, network)))
    response = post_pay(pay_client, shop, intent, payment, checkout=True)
    assert_paid_once(pay_client, shop, devnet, intent, network, response)


def test_the_libraries_refuse_our_asset_without_an_opt_in(devnet):
    """Why the clients above pass allowed assets: the libraries' defaults know only Circle's USDC."""
    req = {"scheme": "exact", "network": "eip155:84532", "maxAmountRequired": "1000000", "resource": "http://x/",
           "description": "", "mimeType": "application/json", "payTo": devnet.buyer(1).address,
           "maxTimeoutSeconds": 120, "asset": devnet.info["networks"]["eip155:84532"]["usdc_address"],
           "extra": {"name": "USDC", "version": "2"}}  # fmt: skip
    client = x402ClientSync()
    register_exact_evm_client(client, devnet.buyer(0))
    with pytest.raises(Exception, match="spend_controls"):
        client.create_payment_payload(PaymentRequired.model_validate(payment_required_v2(req)))
    done = subprocess.run(
        ["node", str(SIGN_MJS)],
        input=json.dumps(
            {
                "paymentRequired": payment_required_v2(req),
                "privateKey": devnet.buyer(0).key.to_0x_hex(),
                "spendControls": {},
            }
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and "spendControls" in done.stderr


# --- v2 `accepted` must be our requirement ------------------------------------------------------


def _set(key: str, value: Any):
    return lambda accepted: {**accepted, key: value}


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (_set("amount", "1"), "AMOUNT_MISMATCH"),
        (_set("maxAmountRequired", "999"), "AMOUNT_MISMATCH"),
        (_set("payTo", "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"), "RECIPIENT_MISMATCH"),
        (_set("asset", "0x036CbD53842c5426634e7929541eC2318f3dCF7e"), "ASSET_MISMATCH"),
        (_set("scheme", "upto"), "UNSUPPORTED_SCHEME"),
        (_set("network", "eip155:1"), "UNSUPPORTED_NETWORK"),
        (_set("network", "base"), "UNSUPPORTED_NETWORK"),
        (_set("amount", "1.5"), "INVALID_PAYLOAD"),
        (lambda a: {k: v for k, v in a.items() if k != "amount"}, "INVALID_PAYLOAD"),
        (_set("network", ""), "INVALID_PAYLOAD"),
    ],
    ids=[
        "amount",
        "max-amount",
        "pay-to",
        "asset",
        "scheme",
        "network",
        "v1-name-not-offered",
        "decimal-amount",
        "no-amount",
        "empty-network",
    ],
)
def test_a_v2_accepted_that_is_not_our_requirement_is_refused(pay_client, shop, devnet, mutate, code):
    network = "eip155:84532"
    intent = create_intent(pay_client, shop)
    payment = npm_sign(devnet.buyer(0), payment_required_v2(requirement(intent, network)))
    payment["accepted"] = mutate(payment["accepted"])
    response = post_pay(pay_client, shop, intent, payment)
    assert response.status_code == 400, response.data
    body = response.get_json()
    assert body["success"] is False and body["error"]["code"] == code, body
    assert devnet.balance(network, shop.payout) == 0
    assert len(events("payment.failed")) == 1  # refused like any other attempt; the intent stays payable


def test_v2_ignores_unknown_fields_resource_and_extensions_and_addresses_case(pay_client, shop, devnet):
    network = "eip155:11155111"
    intent = create_intent(pay_client, shop)
    payment = pypi_sign(devnet.buyer(1), payment_required_v2(requirement(intent, network)))
    payment["accepted"] = {**payment["accepted"], "payTo": payment["accepted"]["payTo"].lower(),
                           "maxTimeoutSeconds": 5, "extra": {"something": "else"}, "futureField": [1]}  # fmt: skip
    payment["resource"] = "not even an object"
    payment["extensions"] = {"bazaar": {"info": {}}}
    payment["somethingNew"] = True
    assert_paid_once(pay_client, shop, devnet, intent, network, post_pay(pay_client, shop, intent, payment))


# --- Solana in v1 (v1 name) and v2 ----------------------------------------------------------------


def test_solana_transaction_in_v1_with_its_v1_name_and_in_v2(pay_client, sol_shop, devnet, sol):  # noqa: F811
    assert devnet.chains.get(SOLANA).x402_v1_name == "solana-devnet"
    first = create_intent(pay_client, sol_shop, 1)
    v1 = {"x402Version": 1, "scheme": "exact", "network": "solana-devnet",
          "payload": signed_payment(pay_client, sol_shop, first, solana_buyer(devnet, 0))}  # fmt: skip
    response = post_pay(pay_client, sol_shop, first, v1)
    assert response.status_code == 200, response.data
    assert response.get_json()["data"]["network"] == SOLANA
    assert usdc(sol, devnet, sol_shop.wallet) == 1_000_000

    second = create_intent(pay_client, sol_shop, 2)
    (req,) = second["payment_requirements"]
    accepted = payment_required_v2(req)["accepts"][0]
    v2 = {"x402Version": 2, "accepted": accepted, "resource": {"url": req["resource"]},
          "payload": signed_payment(pay_client, sol_shop, second, solana_buyer(devnet, 0))}  # fmt: skip
    wrong = {**v2, "accepted": {**accepted, "payTo": str(solana_buyer(devnet, 1).pubkey())}}
    refused = post_pay(pay_client, sol_shop, second, wrong)
    assert refused.status_code == 400 and refused.get_json()["error"]["code"] == "RECIPIENT_MISMATCH"
    response = post_pay(pay_client, sol_shop, second, v2)
    assert response.status_code == 200, response.data
    assert usdc(sol, devnet, sol_shop.wallet) == 3_000_000


# --- malformed forms: clear 400s, never a 500 -----------------------------------------------------


def _nested(payload: dict[str, Any]) -> dict[str, Any]:
    return {"signature": payload["signature"], "authorization": {k: v for k, v in payload.items() if k != "signature"}}


def _v2(payload: dict[str, Any], req: dict[str, Any]) -> dict[str, Any]:
    return {"x402Version": 2, "payload": _nested(payload), "accepted": payment_required_v2(req)["accepts"][0]}


MALFORMED = {
    # name: (build(signed flat payload, requirement) -> payment_signature, status code)
    "v2-without-accepted": (lambda p, r: {"x402Version": 2, "payload": _nested(p)}, "VALIDATION_ERROR"),
    "v2-accepted-not-an-object": (lambda p, r: {**_v2(p, r), "accepted": "exact"}, "VALIDATION_ERROR"),
    "v2-accepted-without-network": (
        lambda p, r: {**_v2(p, r), "accepted": {k: v for k, v in _v2(p, r)["accepted"].items() if k != "network"}},
        "INVALID_PAYLOAD",
    ),
    "v2-accepted-network-not-a-string": (
        lambda p, r: {**_v2(p, r), "accepted": {**_v2(p, r)["accepted"], "network": 84532}},
        "INVALID_PAYLOAD",
    ),
    "v2-top-level-network-contradicts-accepted": (
        lambda p, r: {**_v2(p, r), "network": "eip155:11155111"},
        "INVALID_PAYLOAD",
    ),
    "v2-top-level-scheme-contradicts-accepted": (lambda p, r: {**_v2(p, r), "scheme": "upto"}, "INVALID_PAYLOAD"),
    "v3": (lambda p, r: {**_v2(p, r), "x402Version": 3}, "UNSUPPORTED_X402_VERSION"),
    "v0": (
        lambda p, r: {**_v2(p, r), "x402Version": 0, "scheme": "exact", "network": r["network"]},
        "UNSUPPORTED_X402_VERSION",
    ),
    "v1-without-network": (lambda p, r: {"x402Version": 1, "scheme": "exact", "payload": p}, "VALIDATION_ERROR"),
    "v1-unknown-v1-name": (
        lambda p, r: {"x402Version": 1, "scheme": "exact", "network": "arc-testnet", "payload": _nested(p)},
        "UNSUPPORTED_NETWORK",
    ),
    "nested-authorization-not-an-object": (
        lambda p, r: {**_v2(p, r), "payload": {"signature": p["signature"], "authorization": "x"}},
        "INVALID_PAYLOAD",
    ),
    "nested-without-signature": (
        lambda p, r: {**_v2(p, r), "payload": {"authorization": _nested(p)["authorization"]}},
        "INVALID_PAYLOAD",
    ),
    "nested-without-nonce": (
        lambda p, r: {
            **_v2(p, r),
            "payload": {**_nested(p), "authorization": {k: v for k, v in p.items() if k not in ("nonce", "signature")}},
        },
        "INVALID_PAYLOAD",
    ),
    "nested-and-flat-mixed": (lambda p, r: {**_v2(p, r), "payload": {**p, **_nested(p)}}, "INVALID_PAYLOAD"),
    "nested-signature-not-hex": (
        lambda p, r: {**_v2(p, r), "payload": {**_nested(p), "signature": ["0x"]}},
        "INVALID_PAYLOAD",
    ),
    "payload-not-an-object": (lambda p, r: {**_v2(p, r), "payload": "0xdead"}, "VALIDATION_ERROR"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_nested_and_v2_forms_are_clear_400s(pay_client, shop, devnet, case):
    network = "eip155:84532"
    intent = create_intent(pay_client, shop)
    req = requirement(intent, network)
    build, code = MALFORMED[case]
    payment = build(sign_authorization(devnet.buyer(2).key, req), req)
    response = post_pay(pay_client, shop, intent, payment)
    assert response.status_code == 400, response.data
    body = response.get_json()
    assert body["success"] is False and body["error"]["code"] == code, body
    assert body["error"]["message"]
    if code == "INVALID_PAYLOAD":
        assert body["error"]["field"].startswith("payment_signature.")
    assert devnet.balance(network, shop.payout) == 0
    # Still payable, by the nested form of our own signer's authorization.
    good = {"x402Version": 1, "scheme": "exact", "network": "base-sepolia",
            "payload": _nested(sign_authorization(devnet.buyer(2).key, req))}  # fmt: skip
    assert post_pay(pay_client, shop, intent, good).status_code == 200
