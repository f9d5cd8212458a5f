"""/metrics after real actions: request latency by route, settlements, webhook deliveries, queues, relay gas."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

from redis import Redis
from sqlalchemy import select, update

from backend.app import create_app
from backend.chains.registry import ChainRegistry
from backend.extensions import db
from backend.queueing import queue, relayer_queue
from backend.settlement import intake
from backend.settlement.models import Settlement
from payintent.eip3009 import sign_authorization
from tests.conftest import free_port, make_settings
from tests.intents.helpers import URL, create
from tests.observability.conftest import (
    BASE_SEPOLIA,
    METRICS_TOKEN,
    RELAYER_QUEUE,
    SOLANA,
    chains_file,
    evm_network,
    scrape,
    value,
    with_metrics_token,
)
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.webhooks.helpers import deliver, register, send_test

LATENCY = "payintent_http_request_duration_seconds"
RELAY = "0x90F79bf6EB2c4f870365E785982E1f101E93b906"
FEE_PAYER = "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM"


def test_metrics_are_off_without_a_token_and_need_it_when_set(app):
    client = app.test_client()
    assert client.get("/metrics").status_code == 404  # METRICS_TOKEN unset: nothing shown
    with_metrics_token(app)
    refused = [
        client.get("/metrics"),
        client.get("/metrics", headers={"Authorization": "Bearer wrong-token"}),
        client.get("/metrics", headers={"Authorization": f"Basic {METRICS_TOKEN}"}),
        client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}x"}),
    ]
    assert [r.status_code for r in refused] == [401] * 4
    assert refused[0].headers["WWW-Authenticate"].startswith("Bearer")
    assert refused[0].get_json()["error"]["code"] == "UNAUTHORIZED"
    assert "payintent_" not in refused[1].get_data(as_text=True)
    assert scrape(client)  # the right token: the exposition


def test_request_latency_is_counted_by_method_route_and_status(app, client, merchant):
    with_metrics_token(app)
    route = "/api/v1/x402/intents/<intent_id:intent_id>"

    def count(samples, method, rule, status):
        return value(samples, f"{LATENCY}_count", method=method, route=rule, status=status) or 0

    before = scrape(client)
    intent = create(client, merchant)
    for _ in range(3):
        assert client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers).status_code == 200
    assert client.get(f"{URL}/{uuid.uuid4()}", headers=merchant.headers).status_code == 404
    assert client.get("/no/such/path").status_code == 404
    assert client.open("/healthz", method="BREW").status_code == 405
    after = scrape(client)

    assert count(after, "POST", URL, "201") - count(before, "POST", URL, "201") == 1
    assert count(after, "GET", route, "200") - count(before, "GET", route, "200") == 3
    assert count(after, "GET", route, "404") - count(before, "GET", route, "404") == 1  # an unknown intent
    assert count(after, "GET", "unmatched", "404") - count(before, "GET", "unmatched", "404") == 1
    assert count(after, "OTHER", "unmatched", "405") - count(before, "OTHER", "unmatched", "405") == 1
    # A histogram: the +Inf bucket holds every request, the sum is their time.
    labels = {"method": "GET", "route": route, "status": "200"}
    assert value(after, f"{LATENCY}_bucket", le="+Inf", **labels) == count(after, "GET", route, "200")
    assert value(after, f"{LATENCY}_sum", **labels) > (value(before, f"{LATENCY}_sum", **labels) or 0)
    # No path holds an id: the route is the URL rule.
    assert not any(intent["intent_id"] in dict(labels).get("route", "") for _, labels in after)


def test_webhook_deliveries_by_outcome_and_the_oldest_due(app, client, merchant, receiver, clock):
    with_metrics_token(app)

    def deliveries(samples):
        statuses = ("pending", "succeeded", "failed", "cancelled")
        return {s: value(samples, "payintent_webhook_deliveries", status=s) for s in statuses}

    ok = register(client, merchant, receiver.url("/ok"))
    failing = register(client, merchant, receiver.url("/status/500"))
    send_test(client, merchant, ok["webhook_id"])
    send_test(client, merchant, failing["webhook_id"])
    samples = scrape(client)
    assert deliveries(samples) == {"pending": 2, "succeeded": 0, "failed": 0, "cancelled": 0}
    assert value(samples, "payintent_webhook_oldest_due_seconds") == 0

    clock.advance(seconds=42)  # no worker ran: both have waited 42 s
    assert value(scrape(client), "payintent_webhook_oldest_due_seconds") == 42

    assert deliver() == 2  # one succeeds, the other answers 500 and is retried in 60 s
    receiver.wait_for(2)
    samples = scrape(client)
    assert deliveries(samples) == {"pending": 1, "succeeded": 1, "failed": 0, "cancelled": 0}
    assert value(samples, "payintent_webhook_oldest_due_seconds") == 0  # the retry is not due yet

    clock.advance(seconds=75)  # the retry fell due 15 s ago
    assert value(scrape(client), "payintent_webhook_oldest_due_seconds") == 15
    assert value(scrape(client), "payintent_metrics_source_up", source="database") == 1


def test_a_settlement_left_in_flight_shows_its_age(app, client, merchant, clock):
    with_metrics_token(app)
    intent = create(client, merchant)
    now = clock.current
    db.session.add(Settlement(
        id="stl_stuck", intent_id=intent["intent_id"], merchant_id=merchant.id, network=BASE_SEPOLIA,
        asset="0x036CbD53842c5426634e7929541eC2318f3dCF7e", payer=RELAY, pay_to=RELAY, amount_atomic=1,
        valid_after=0, valid_before=2**40, nonce="0x" + "00" * 32, signature="0x", status="submitted",
        created_at=now, updated_at=now,
    ))  # fmt: skip
    db.session.commit()
    clock.advance(seconds=90)
    samples = scrape(client)
    assert value(samples, "payintent_settlement_oldest_open_seconds") == 90
    assert value(samples, "payintent_settlements", network=BASE_SEPOLIA, status="submitted") == 1
    db.session.execute(update(Settlement).values(status="confirmed"))
    db.session.commit()
    samples = scrape(client)
    assert value(samples, "payintent_settlement_oldest_open_seconds") == 0
    assert value(samples, "payintent_settlements", network=BASE_SEPOLIA, status="confirmed") == 1
    assert value(samples, "payintent_settlements", network=BASE_SEPOLIA, status="submitted") is None


def test_queue_depth_is_read_from_redis_and_a_dead_redis_costs_only_its_own_metrics(db_url, redis_url):
    name = f"relayer-depth-{uuid.uuid4().hex[:8]}"
    app = with_metrics_token(create_app(make_settings(db_url, redis_url=redis_url, relayer_queue=name)))
    connection = Redis.from_url(redis_url)
    for n in range(3):
        intake.push(connection, f"stl_{n}", BASE_SEPOLIA, None, base=name)
    queue(relayer_queue(name, BASE_SEPOLIA), connection).enqueue("relayer.tasks.settle", "stl_old")  # RQ: not read
    samples = scrape(app.test_client())
    assert value(samples, "payintent_queue_depth", queue=relayer_queue(name, BASE_SEPOLIA)) == 3
    assert value(samples, "payintent_queue_depth", queue=relayer_queue(name, "eip155:11155111")) == 0
    assert value(samples, "payintent_queue_depth", queue="payintent") == 0
    assert value(samples, "payintent_queue_depth", queue="payintent-webhooks") == 0
    assert value(samples, "payintent_metrics_source_up", source="redis") == 1

    down = replace(app.config["PAYINTENT_SETTINGS"], redis_url=f"redis://127.0.0.1:{free_port()}/0")
    samples = scrape(with_metrics_token(create_app(down)).test_client())
    assert value(samples, "payintent_metrics_source_up", source="redis") == 0
    assert value(samples, "payintent_queue_depth", queue=name) is None
    assert value(samples, "payintent_metrics_source_up", source="database") == 1
    assert value(samples, "payintent_webhook_deliveries", status="pending") is not None  # the database still read


def test_relay_gas_balances_are_read_from_each_chain_and_cached(db_url, stub_rpc, tmp_path):
    stub_rpc.balances = {RELAY.lower(): 1_500_000_000_000_000_000, FEE_PAYER: 250_000_000}
    dead = f"http://127.0.0.1:{free_port()}/v2/dead-key-0123456789"
    path = chains_file(tmp_path / "chains.json", [
        evm_network(stub_rpc.url, relay_addresses=[RELAY]),
        evm_network(dead, "eip155:11155111", relay_addresses=[RELAY]),
        {"network": SOLANA, "rpc_url": stub_rpc.url, "fee_payer": FEE_PAYER,
         "usdc_address": "4zMMC9srt5Ri5X14GAgXhaHii3GnPAEERYPJgZJDncDU"},
    ])  # fmt: skip
    app = with_metrics_token(create_app(make_settings(db_url, chains_file=str(path)), ChainRegistry.load(str(path))))
    client = app.test_client()
    started = time.monotonic()
    samples = scrape(client)
    assert time.monotonic() - started < 5  # the dead RPC costs one 2 s timeout at most
    gas = "payintent_relay_gas_balance"
    assert value(samples, gas, network=BASE_SEPOLIA, address=RELAY) == 1.5  # ETH
    assert value(samples, gas, network=SOLANA, address=FEE_PAYER) == 0.25  # SOL
    assert value(samples, gas, network="eip155:11155111", address=RELAY) is None
    up = "payintent_relay_gas_rpc_up"
    assert [value(samples, up, network=n) for n in (BASE_SEPOLIA, SOLANA, "eip155:11155111")] == [1, 1, 0]
    calls = len(stub_rpc.calls)
    assert sorted(stub_rpc.calls) == ["eth_getBalance", "getBalance"]
    for _ in range(3):
        assert value(scrape(client), gas, network=BASE_SEPOLIA, address=RELAY) == 1.5
    assert len(stub_rpc.calls) == calls  # scrapes within 30 s reuse the answer
    raw = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).get_data(as_text=True)
    assert "dead-key" not in raw and "stub-provider-key" not in raw and "127.0.0.1" not in raw


def test_a_payment_on_the_devnet_shows_in_metrics_and_in_the_relayers_log(pay_client, shop, devnet, relayer):
    network = BASE_SEPOLIA
    before = scrape(pay_client)
    intent = create_intent(pay_client, shop, 1.25)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, network))
    request_id = f"pay-{uuid.uuid4().hex[:12]}"
    signature = {"scheme": "exact", "network": network, "x402Version": 1, "payload": payload}
    body = {"intent_id": intent["intent_id"], "payment_signature": signature}
    response = pay_client.post("/api/v1/x402/pay", json=body, headers={**shop.headers, "X-Request-Id": request_id})
    assert response.status_code == 200, response.data
    assert response.headers["X-Request-Id"] == request_id
    settlement_id = db.session.scalar(select(Settlement.id).where(Settlement.intent_id == intent["intent_id"]))
    # A refused second payment of the same intent is no settlement.
    again = sign_authorization(devnet.buyer(1).key, requirement(intent, network))
    assert pay(pay_client, shop, intent, network, again).status_code == 409

    samples = scrape(pay_client)
    assert value(samples, "payintent_settlements", network=network, status="confirmed") == 1
    assert [k for k in samples if k[0] == "payintent_settlements"] == [
        ("payintent_settlements", frozenset({("network", network), ("status", "confirmed")}))
    ]
    pay_route = {"method": "POST", "route": "/api/v1/x402/pay"}
    for status, added in (("200", 1), ("409", 1)):
        old = value(before, f"{LATENCY}_count", status=status, **pay_route) or 0
        assert value(samples, f"{LATENCY}_count", status=status, **pay_route) - old == added
    assert value(samples, "payintent_settlement_oldest_open_seconds") == 0  # none left in flight
    assert value(samples, "payintent_queue_depth", queue=relayer_queue(RELAYER_QUEUE, network)) == 0  # taken
    # Gas: cached for 30 s (this app read it before paying); a fresh app reads what the chain holds now.
    relay = db.session.get(Settlement, settlement_id).relay_address
    assert relay in devnet.chains.get(network).relay_addresses
    fresh = scrape(create_app(pay_client.application.config["PAYINTENT_SETTINGS"], devnet.chains).test_client())

    def gas(samples, address):
        return value(samples, "payintent_relay_gas_balance", network=network, address=address)

    assert gas(samples, relay) == gas(before, relay)
    for address in devnet.chains.get(network).relay_addresses:
        assert gas(fresh, address) == float(Decimal(devnet.w3(network).eth.get_balance(address)) / Decimal(10**18))
    assert 0 < gas(before, relay) - gas(fresh, relay) < 0.01  # the gas of one transferWithAuthorization
    every_network = {*devnet.networks, devnet.info["solana"]["network"]}
    assert {n for n in every_network if value(samples, "payintent_relay_gas_rpc_up", network=n) == 1} == every_network

    # The relayer's JSON log: its line for this settlement carries the /pay call's request id.
    logged = [json.loads(line) for line in relayer.log_path.read_text().splitlines() if line.startswith("{")]
    (settled,) = [line for line in logged if line["message"] == f"settlement {settlement_id}: confirmed"]
    assert settled["request_id"] == request_id and settled["job_id"] == f"settle-{settlement_id}"
    assert settled["logger"] == "relayer.tasks" and settled["level"] == "INFO"
    relay_keys = json.loads(Path(devnet.info["relay_keys_file"]).read_text())
    text = relayer.log_path.read_text()
    assert not [key for keys in relay_keys.values() for key in keys if key.removeprefix("0x") in text]
