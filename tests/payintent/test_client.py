"""payintent.client over real HTTP, on the real devnet with a real relayer: money moves once."""

from __future__ import annotations

import json
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import requests
from eth_account import Account
from requests.adapters import HTTPAdapter

from payintent import NoFundedNetworkError, PayIntentClient, PayIntentError

PAY_PATH = "/api/v1/x402/pay"
ARTIFACT = Path(__file__).resolve().parents[2] / "devnet" / "artifacts" / "TestUSDC.json"


# --- helpers -------------------------------------------------------------------------------------


class Recorder(HTTPAdapter):
    """Forwards requests for real and records them; ``fault`` may replace the answer to a /pay.

    ``fault(call_number, forward)`` returns a Response, raises, or returns None for the real one;
    ``forward()`` sends the request to the server and returns its real answer.
    """

    def __init__(self, fault: Any = None) -> None:
        super().__init__()
        self.fault = fault
        self.pays: list[dict[str, Any]] = []

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        def forward() -> requests.Response:
            return super(Recorder, self).send(request, *args, **kwargs)

        if request.method == "POST" and request.path_url == PAY_PATH:
            self.pays.append(json.loads(request.body))
            if self.fault is not None:
                answer = self.fault(len(self.pays), forward)
                if answer is not None:
                    answer.request = request
                    return answer
        return forward()


def fake_response(status: int, body: Any) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    if isinstance(body, str):
        response._content = body.encode()
        response.headers["Content-Type"] = "text/html"
    else:
        response._content = json.dumps(body).encode()
        response.headers["Content-Type"] = "application/json"
    return response


def make_client(api_url: str, shop: Any, devnet: Any, adapter: HTTPAdapter | None = None, **kwargs: Any) -> Any:
    session = requests.Session()
    if adapter is not None:
        session.mount("http://", adapter)
    rpc_urls = {network: chain["rpc_url"] for network, chain in devnet.info["networks"].items()}
    return PayIntentClient(api_url, shop.api_key, session=session, rpc_urls=rpc_urls, **kwargs)


def mint(devnet: Any, network: str, to: str, amount: int) -> None:
    """Test USDC for ``to`` on one chain only, minted by the token owner (the devnet deployer)."""
    state = json.loads((Path(devnet.info["chains_file"]).parent / "state.json").read_text())  # this devnet's
    deployer = Account.from_key(state["deployer"]["private_key"])
    w3 = devnet.w3(network)
    token = w3.eth.contract(address=devnet.info["networks"][network]["usdc_address"], abi=_abi())
    tx = token.functions.mint(to, amount).build_transaction(
        {"from": deployer.address, "nonce": w3.eth.get_transaction_count(deployer.address, "pending")}
    )
    receipt = w3.eth.wait_for_transaction_receipt(
        w3.eth.send_raw_transaction(deployer.sign_transaction(tx).raw_transaction), timeout=10
    )
    assert receipt["status"] == 1


def _abi() -> Any:
    return json.loads(ARTIFACT.read_text())["abi"]


def balances(devnet: Any, address: str) -> dict[str, int]:
    return {network: devnet.balance(network, address) for network in devnet.networks}


def assert_paid_once(client: Any, devnet: Any, shop: Any, intent: dict[str, Any], result: dict[str, Any]) -> None:
    read = client.get_intent(intent["intent_id"])
    assert read["status"] == "paid"
    assert read["tx_hash"] == result["tx_hash"] and read["chain"] == result["network"]
    assert read["buyer_address"] == result["buyer_address"]
    receipt = devnet.w3(result["network"]).eth.get_transaction_receipt(result["tx_hash"])
    assert receipt["status"] == 1
    atomic = int(intent["payment_requirements"][0]["maxAmountRequired"])
    payout = balances(devnet, shop.payout)
    assert payout == {n: (atomic if n == result["network"] else 0) for n in devnet.networks}


# --- intents -------------------------------------------------------------------------------------


def test_create_read_list_cancel(api_url, shop, devnet):
    with make_client(api_url, shop, devnet) as client:
        key = f"order-7-{uuid.uuid4().hex}"
        created = client.create_intent(
            Decimal("10.000001"), order_id="order-7", description="Two mugs", metadata={"n": 2}, idempotency_key=key
        )
        assert created["status"] == "pending" and created["amount_usdc"] == Decimal("10.000001")
        assert {r["network"] for r in created["payment_requirements"]} == set(devnet.networks)
        assert {r["maxAmountRequired"] for r in created["payment_requirements"]} == {"10000001"}
        replayed = client.create_intent(
            "10.000001", order_id="order-7", description="Two mugs", metadata={"n": 2}, idempotency_key=key
        )
        assert replayed == created
        other = client.create_intent(3, order_id="order-8")
        assert other["amount_usdc"] == 3

        read = client.get_intent(created["intent_id"])
        assert read["metadata"] == {"n": 2} and read["description"] == "Two mugs"
        page = client.list_intents(order_id="order-7")
        assert page["total"] == 1 and [i["intent_id"] for i in page["intents"]] == [created["intent_id"]]
        page = client.list_intents(status="pending", limit=1, offset=0)
        assert page["total"] == 2 and page["limit"] == 1 and page["intents"][0]["intent_id"] == other["intent_id"]

        assert client.cancel_intent(created["intent_id"]) == {"intent_id": created["intent_id"], "status": "cancelled"}
        assert client.get_intent(created["intent_id"])["status"] == "cancelled"
        with pytest.raises(PayIntentError) as refused:
            client.cancel_intent(created["intent_id"])
        assert refused.value.status == 404 and refused.value.code == "INTENT_NOT_CANCELLABLE"
        assert client.list_intents(status="cancelled")["total"] == 1


def test_errors_are_raised_with_status_code_and_body(api_url, shop, devnet):
    with make_client(api_url, shop, devnet) as client:
        with pytest.raises(PayIntentError) as missing:
            client.get_intent(str(uuid.uuid4()))
        assert (missing.value.status, missing.value.code) == (404, "NOT_FOUND")
        assert missing.value.body["success"] is False and not missing.value.transient
        with pytest.raises(PayIntentError) as invalid:
            client.create_intent(Decimal("0.0000001"))
        assert (invalid.value.status, invalid.value.code) == (400, "VALIDATION_ERROR")
        with pytest.raises(TypeError):
            client.create_intent(10.5)  # a float is never exact: refused before sending
    with PayIntentClient(api_url, "sk_test_" + "x" * 43) as stranger, pytest.raises(PayIntentError) as denied:
        stranger.list_intents()
    assert (denied.value.status, denied.value.code) == (401, "UNAUTHORIZED")
    with PayIntentClient("http://127.0.0.1:9", "sk_test_x", timeout=2) as nowhere, pytest.raises(PayIntentError) as e:
        nowhere.list_intents()
    assert e.value.status is None and e.value.code == "NETWORK_ERROR" and e.value.transient


# --- paying --------------------------------------------------------------------------------------


def test_pay_uses_the_network_where_the_account_holds_usdc(api_url, shop, devnet):
    with make_client(api_url, shop, devnet) as client:
        intent = client.create_intent(Decimal("2.5"), order_id="agent-1")
        funded = intent["payment_requirements"][-1]["network"]  # not the first: the balance decides
        agent = Account.create()
        mint(devnet, funded, agent.address, 2_500_000)
        result = client.pay(intent, agent)
    assert result["network"] == funded and result["intent_id"] == intent["intent_id"]
    assert result["buyer_address"] == agent.address and result["amount_usdc"] == Decimal("2.5")
    assert_paid_once(client, devnet, shop, intent, result)
    assert balances(devnet, agent.address) == dict.fromkeys(devnet.networks, 0)


def test_pay_refuses_when_no_network_has_enough(api_url, shop, devnet):
    adapter = Recorder()
    with make_client(api_url, shop, devnet, adapter) as client:
        intent = client.create_intent(1, order_id="poor")
        first, second = devnet.networks[:2]
        agent = Account.create()
        mint(devnet, first, agent.address, 999_999)  # one atomic unit short
        mint(devnet, second, agent.address, 1_000_000)
        with pytest.raises(NoFundedNetworkError) as refused:
            client.pay(intent, agent.key, rpc_urls={first: devnet.info["networks"][first]["rpc_url"]}, max_attempts=1)
        assert refused.value.code == "NO_FUNDED_NETWORK" and refused.value.balances[first] == 999_999
        assert refused.value.balances[second] == "no RPC URL given"  # funded, but not reachable by this caller
        assert adapter.pays == []
        assert client.get_intent(intent["intent_id"])["status"] == "pending"


def test_pay_checks_the_rpc_url_serves_the_network(api_url, shop, devnet):
    first, second = devnet.networks[:2]
    wrong = {first: devnet.info["networks"][second]["rpc_url"]}  # mixed up: the balance would be another chain's
    with make_client(api_url, shop, devnet) as client:
        intent = client.create_intent(1)
        with pytest.raises(NoFundedNetworkError) as refused:
            client.pay(intent, devnet.buyer(0), rpc_urls=wrong)
    assert "serves chain id" in refused.value.balances[first]


def test_pay_on_a_paid_intent_returns_the_paid_data(api_url, shop, devnet):
    adapter = Recorder()
    with make_client(api_url, shop, devnet, adapter) as client:
        intent = client.create_intent(Decimal("1.25"))
        first = client.pay(intent["intent_id"], devnet.buyer(0))
        assert len(adapter.pays) == 1
        again = client.pay(intent["intent_id"], devnet.buyer(1))  # reads it first: paid, nothing sent
        assert len(adapter.pays) == 1
        stale = client.pay(intent, devnet.buyer(1))  # a stale copy: the server answers ALREADY_PAID
        assert len(adapter.pays) == 2
    assert again == stale
    assert {k: again[k] for k in ("tx_hash", "network", "buyer_address", "intent_id")} == {
        k: first[k] for k in ("tx_hash", "network", "buyer_address", "intent_id")
    }
    assert again["buyer_address"] == devnet.buyer(0).address
    assert_paid_once(client, devnet, shop, intent, first)


def _bad_gateway(forward: Any) -> requests.Response:
    forward()
    return fake_response(502, "<html>502 Bad Gateway</html>")


def _still_settling(forward: Any) -> requests.Response:
    forward()
    return fake_response(504, {"success": False, "error": {"code": "SETTLEMENT_PENDING", "message": "settling"}})


def _connection_reset(forward: Any) -> requests.Response:
    forward()
    raise requests.ConnectionError("connection reset by peer")


@pytest.mark.parametrize("lose_answer", [_bad_gateway, _still_settling, _connection_reset])
def test_a_lost_answer_is_read_before_any_retry(api_url, shop, devnet, lose_answer):
    """The server settled, but the answer never arrived: the client reads the intent, pays nothing more."""
    buyer = devnet.buyer(2)
    before = balances(devnet, buyer.address)
    sleeps: list[float] = []
    adapter = Recorder(lambda n, forward: lose_answer(forward) if n == 1 else None)
    with make_client(api_url, shop, devnet, adapter, sleep=sleeps.append) as client:
        intent = client.create_intent(Decimal("1.5"))
        result = client.pay(intent, buyer)
    assert len(adapter.pays) == 1 and sleeps == []
    assert_paid_once(client, devnet, shop, intent, result)
    after = balances(devnet, buyer.address)
    assert {n: before[n] - after[n] for n in before} == {
        n: (1_500_000 if n == result["network"] else 0) for n in devnet.networks
    }


def test_a_call_that_never_arrived_is_polled_then_resigned(api_url, shop, devnet):
    sleeps: list[float] = []
    adapter = Recorder(lambda n, forward: fake_response(503, "<html>503</html>") if n == 1 else None)
    with make_client(api_url, shop, devnet, adapter, sleep=sleeps.append, poll_attempts=4) as client:
        intent = client.create_intent(Decimal("0.75"))
        result = client.pay(intent, devnet.buyer(0))
    assert sleeps == [3.0] * 4  # read, then 4 polls 3 s apart while pending, then a fresh authorization
    assert len(adapter.pays) == 2
    nonces = [p["payment_signature"]["payload"]["nonce"] for p in adapter.pays]
    assert nonces[0] != nonces[1] and all(len(n) == 66 for n in nonces)
    assert_paid_once(client, devnet, shop, intent, result)


def test_gives_up_after_max_attempts_and_moves_nothing(api_url, shop, devnet):
    sleeps: list[float] = []
    adapter = Recorder(lambda n, forward: fake_response(502, "bad gateway"))
    with make_client(api_url, shop, devnet, adapter, sleep=sleeps.append, poll_attempts=1) as client:
        intent = client.create_intent(1)
        with pytest.raises(PayIntentError) as failed:
            client.pay(intent, devnet.buyer(1), max_attempts=2)
        assert failed.value.status == 502 and failed.value.transient
        assert len(adapter.pays) == 2 and sleeps == [3.0, 3.0]
        assert client.get_intent(intent["intent_id"])["status"] == "pending"
    assert balances(devnet, shop.payout) == dict.fromkeys(devnet.networks, 0)


def test_the_authorization_is_signed_at_the_clock_time_and_valid_for_900_seconds(api_url, shop, devnet):
    signed_at = int(time.time()) - 3600  # an hour slow: the authorization has expired by the server's clock
    adapter = Recorder()
    with make_client(api_url, shop, devnet, adapter, clock=lambda: float(signed_at)) as client:
        intent = client.create_intent(1)
        with pytest.raises(PayIntentError) as refused:
            client.pay(intent, devnet.buyer(0))
    assert (refused.value.status, refused.value.code) == (400, "AUTHORIZATION_EXPIRED")
    signature = adapter.pays[0]["payment_signature"]
    assert signature["x402Version"] == 1 and signature["scheme"] == "exact"
    assert signature["payload"]["validAfter"] == "0"
    assert signature["payload"]["validBefore"] == str(signed_at + 900)
    assert balances(devnet, shop.payout) == dict.fromkeys(devnet.networks, 0)


def test_4xx_is_raised_and_a_cancelled_intent_is_not_paid(api_url, shop, devnet):
    adapter = Recorder()
    with make_client(api_url, shop, devnet, adapter) as client:
        intent = client.create_intent(1)
        client.cancel_intent(intent["intent_id"])
        with pytest.raises(PayIntentError) as stale:  # a stale pending copy: the server refuses
            client.pay(intent, devnet.buyer(0))
        assert (stale.value.status, stale.value.code) == (409, "INTENT_CANCELLED")
        assert len(adapter.pays) == 1
        with pytest.raises(PayIntentError) as read:  # by id: read first, nothing signed or sent
            client.pay(intent["intent_id"], devnet.buyer(0))
        assert read.value.code == "INTENT_CANCELLED" and len(adapter.pays) == 1
    assert balances(devnet, shop.payout) == dict.fromkeys(devnet.networks, 0)


def test_pay_with_a_solana_keypair(api_url, pay_app, devnet):
    from solders.keypair import Keypair
    from solders.pubkey import Pubkey

    from backend.chains.solana import SolanaChain
    from payintent import solana_tx
    from tests.conftest import create_merchant

    network = devnet.info["solana"]["network"]
    wallet = Keypair().pubkey()
    shop = create_merchant(pay_app, f"client-sol-{uuid.uuid4().hex[:6]}@example.com", {network: str(wallet)})
    buyer = Keypair.from_base58_string(devnet.info["solana_buyers"][1]["secret_key"])
    chain = SolanaChain(devnet.info["solana"]["rpc_url"])
    mint_key = Pubkey.from_string(devnet.info["solana"]["usdc_mint"])
    merchant_account = str(solana_tx.associated_token_address(wallet, mint_key))
    with PayIntentClient(api_url, shop.api_key) as client:
        intent = client.create_intent(Decimal("1.25"), order_id="sol-agent")
        # A first payment opens the merchant's USDC account at the payer's cost: a caller can see it and cap it.
        with pytest.raises(PayIntentError) as capped:
            client.pay(intent, buyer, max_rent_lamports=solana_tx.TOKEN_ACCOUNT_RENT - 1)
        assert capped.value.code == "RENT_ABOVE_LIMIT" and capped.value.status is None
        assert capped.value.body == {"payer_pays_lamports": solana_tx.TOKEN_ACCOUNT_RENT}
        assert client.get_intent(intent["intent_id"])["status"] == "pending"
        assert chain.token_balance(merchant_account) is None  # nothing signed, nothing sent
        result = client.pay(intent, buyer, max_rent_lamports=solana_tx.TOKEN_ACCOUNT_RENT)
        assert client.get_intent(intent["intent_id"])["status"] == "paid"
        assert result["payer_pays_lamports"] == solana_tx.TOKEN_ACCOUNT_RENT == chain.rent_exempt_minimum(165)
        second = client.pay(client.create_intent(Decimal("1"), order_id="sol-agent-2"), buyer, max_rent_lamports=0)
        assert second["payer_pays_lamports"] == 0  # the account exists now: nothing but the USDC
    assert result["network"] == network and result["buyer_address"] == str(buyer.pubkey())
    assert chain.token_balance(merchant_account) == 2_250_000
    assert chain.signature_status(result["tx_hash"])["err"] is None
