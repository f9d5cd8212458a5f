"""Abuse limits on the keyed API: per key, per client IP, failed authentications; closed CORS; no caching."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from backend.merchants import services
from tests.intents.helpers import URL


def limits(app: Any, **values: int) -> None:
    app.config["PAYINTENT_SETTINGS"] = dataclasses.replace(app.config["PAYINTENT_SETTINGS"], **values)


def test_each_api_key_has_its_own_budget(app, client, merchant, clock):
    limits(app, api_requests_per_minute_per_key=3)
    codes = [client.get(URL, headers=merchant.headers).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]
    limited = client.get(URL, headers=merchant.headers)
    assert limited.get_json()["error"]["code"] == "RATE_LIMITED" and 1 <= int(limited.headers["Retry-After"]) <= 60
    second_key = services.create_api_key(merchant.id).secret  # another key of the same merchant: its own budget
    assert client.get(URL, headers={"Authorization": f"Bearer {second_key}"}).status_code == 200
    clock.advance(seconds=61)  # a new window
    assert client.get(URL, headers=merchant.headers).status_code == 200


def test_one_client_address_is_limited_whatever_keys_it_uses(app, client, merchant, other_merchant):
    limits(app, api_requests_per_minute_per_ip=4)
    codes = [client.get(URL, headers=h).status_code for h in [merchant.headers, other_merchant.headers] * 3]
    assert codes == [200, 200, 200, 200, 429, 429]
    elsewhere = client.get(URL, headers=merchant.headers, environ_base={"REMOTE_ADDR": "203.0.113.9"})
    assert elsewhere.status_code == 200


def test_guessing_keys_turns_401_into_429(app, client, merchant):
    limits(app, api_auth_failures_per_minute=3)
    wrong = {"Authorization": "Bearer sk_test_" + "x" * 40}
    codes = [client.get(URL, headers=wrong).status_code for _ in range(3)] + [client.get(URL).status_code]
    assert codes == [401, 401, 401, 429]
    assert client.get(URL, headers=merchant.headers).status_code == 200  # a valid key still works


def test_the_api_is_not_cached_and_sends_no_cors_headers(client, merchant):
    created = client.post(URL, json={"amount_usdc": 1}, headers={**merchant.headers, "Origin": "https://evil.example"})
    assert created.status_code == 201
    assert created.headers["Cache-Control"] == "no-store" and created.headers["X-Content-Type-Options"] == "nosniff"
    assert not [name for name, _ in created.headers if name.lower().startswith("access-control-")]
    preflight = client.options(URL, headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "Access-Control-Allow-Origin" not in preflight.headers


def test_keys_are_never_stored_in_clear_by_the_limiter(app, client, merchant):
    from backend.ephemeral import memory_store

    limits(app, api_requests_per_minute_per_key=1000)
    assert client.get(URL, headers=merchant.headers).status_code == 200
    names = list(memory_store()._data)  # this test app's in-process counters (no Redis here)
    assert names and not [n for n in names if merchant.api_key in n]


def test_behind_a_trusted_proxy_the_forwarded_client_is_counted(db_url, chains, app, merchant):
    from backend.app import create_app
    from tests.conftest import make_settings

    proxied = create_app(make_settings(db_url, trusted_proxy_hops=1, api_requests_per_minute_per_ip=1), chains=chains)
    client = proxied.test_client()

    def get(forwarded_for: str) -> int:
        return client.get(URL, headers={**merchant.headers, "X-Forwarded-For": forwarded_for}).status_code

    assert [get("198.51.100.1"), get("198.51.100.1"), get("198.51.100.2")] == [200, 429, 200]


def test_an_ipv6_client_is_counted_by_its_64_whatever_address_it_takes(db_url, chains, app, merchant):
    """An IPv6 host usually holds a whole /64: one fresh address per request used to be a fresh budget."""
    from backend.app import create_app
    from tests.conftest import make_settings

    proxied = create_app(make_settings(db_url, trusted_proxy_hops=1, api_requests_per_minute_per_ip=2), chains=chains)
    client = proxied.test_client()

    def get(forwarded_for: str) -> int:
        return client.get(URL, headers={**merchant.headers, "X-Forwarded-For": forwarded_for}).status_code

    rotating = [get(f"2001:db8:a:b:{n:x}::1") for n in range(1, 5)]  # four addresses of one /64
    assert rotating == [200, 200, 429, 429]
    assert get("2001:db8:a:c::1") == 200  # the next /64: another client
    # IPv4 keeps the whole address; an IPv4-mapped IPv6 address is that IPv4 client.
    assert [get("198.51.100.7"), get("198.51.100.8"), get("::ffff:198.51.100.7"), get("198.51.100.7")] == [
        200,
        200,
        200,
        429,
    ]


def test_the_public_checkout_counts_ipv6_clients_by_their_64(client, monkeypatch):
    from backend.checkout import services as checkout_services

    monkeypatch.setattr(checkout_services, "READS_PER_MINUTE", 2)
    url = "/api/v1/checkout/intents/00000000-0000-4000-8000-000000000000"
    codes = [client.get(url, environ_base={"REMOTE_ADDR": f"2001:db8:1:2::{n:x}"}).status_code for n in range(1, 5)]
    assert codes == [404, 404, 429, 429]
    assert client.get(url, environ_base={"REMOTE_ADDR": "2001:db8:1:3::1"}).status_code == 404


def test_client_key():
    from backend.ratelimit import client_key

    assert client_key("203.0.113.9") == "203.0.113.9"
    assert client_key("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
    assert client_key("fe80::1%eth0") == "fe80::/64"
    assert client_key("::ffff:203.0.113.9") == "203.0.113.9"
    assert client_key("") == "unknown" and client_key("not-an-ip") == "not-an-ip"


def test_a_proxied_request_while_trusted_proxy_hops_is_0_is_logged_once(app, client, merchant, caplog, monkeypatch):
    """Behind a proxy with TRUSTED_PROXY_HOPS=0 every client is the proxy, one bucket for all: say so."""
    from backend import ratelimit

    monkeypatch.setattr(ratelimit, "_warned_about_forwarded_for", False)
    with caplog.at_level("WARNING", logger="backend.ratelimit"):
        client.get(URL, headers=merchant.headers)
        assert not caplog.records
        for _ in range(3):
            client.get(URL, headers={**merchant.headers, "X-Forwarded-For": "198.51.100.1"})
    warnings = [r.getMessage() for r in caplog.records if "TRUSTED_PROXY_HOPS is 0" in r.getMessage()]
    assert len(warnings) == 1 and "Set TRUSTED_PROXY_HOPS to the number of proxies" in warnings[0]


@pytest.fixture(params=["memory", "redis"])
def counters(request: Any, app: Any) -> str:
    """Where the limits count: the in-process store, or Redis (the count-ahead script, one round trip)."""
    if request.param == "redis":
        limits(app, redis_url=request.getfixturevalue("redis_url"))
    return str(request.param)


def test_reads_and_creates_count_each_limit_once_per_request(app, client, merchant, counters):
    """The hot GET and POST count the key and the client (IP) in one round trip once the key's window is open:
    still exactly once per request each, the key's after the key is checked."""
    intent_id = client.post(URL, json={"amount_usdc": 1}, headers=merchant.headers).get_json()["data"]["intent_id"]
    limits(app, api_requests_per_minute_per_key=3, api_requests_per_minute_per_ip=1000)
    calls = [
        lambda: client.get(f"{URL}/{intent_id}", headers=merchant.headers),
        lambda: client.post(URL, json={"amount_usdc": 1}, headers=merchant.headers),
    ]
    codes = [calls[i % 2]().status_code for i in range(5)]
    assert codes == [200, 201, 200, 429, 429]
    limited = client.get(f"{URL}/{intent_id}", headers=merchant.headers)
    assert limited.get_json()["error"]["code"] == "RATE_LIMITED" and 1 <= int(limited.headers["Retry-After"]) <= 60
    second_key = services.create_api_key(merchant.id).secret  # another key of the same merchant: its own budget
    assert client.get(f"{URL}/{intent_id}", headers={"Authorization": f"Bearer {second_key}"}).status_code == 200

    limits(app, api_requests_per_minute_per_key=1000, api_requests_per_minute_per_ip=8)  # 8 - the 7 above = 1 left
    assert client.get(f"{URL}/{intent_id}", headers=merchant.headers).status_code == 200
    assert client.get(f"{URL}/{intent_id}", headers=merchant.headers).status_code == 429
    assert client.get(f"{URL}/{intent_id}", environ_base={"REMOTE_ADDR": "203.0.113.9"}).status_code == 401


def test_a_made_up_or_revoked_key_is_401_not_429_and_opens_no_window(app, client, merchant, counters):
    from backend.ephemeral import memory_store

    intent_id = client.post(URL, json={"amount_usdc": 1}, headers=merchant.headers).get_json()["data"]["intent_id"]
    limits(app, api_requests_per_minute_per_key=1, api_requests_per_minute_per_ip=1000)
    wrong = {"Authorization": "Bearer sk_test_" + "y" * 40}
    assert [client.get(f"{URL}/{intent_id}", headers=wrong).status_code for _ in range(3)] == [401, 401, 401]
    if counters == "redis":
        from redis import Redis

        names = [n.decode() for n in Redis.from_url(app.config["PAYINTENT_SETTINGS"].redis_url).keys("*rl:api:key:*")]
    else:
        names = [n for n in memory_store()._data if "rl:api:key:" in n]
    assert names == []  # no window for the made-up key
    key_id = services.list_api_keys(merchant.id)[0].id
    assert [client.get(f"{URL}/{intent_id}", headers=merchant.headers).status_code for _ in range(2)] == [200, 429]
    services.revoke_api_key(merchant.id, key_id)
    assert client.get(f"{URL}/{intent_id}", headers=merchant.headers).status_code == 401  # revoked: at once


def test_incr_pair_counts_the_second_only_while_live_and_within_the_first_limit(app, counters):
    from backend.ephemeral import store

    with app.app_context():
        counters_ = store()
        for name in ("a", "b"):
            counters_.delete(name)
        assert counters_.incr_pair("a", "b", 60, 2) == (1, None)  # "b" has no window: left alone
        assert counters_.count("b") == (0, 0)
        assert counters_.incr("b", 60) == 1
        assert counters_.incr_pair("a", "b", 60, 2) == (2, 2)
        assert counters_.incr_pair("a", "b", 60, 2) == (3, None)  # "a" past its limit: "b" not counted
        assert counters_.count("a")[0] == 3 and counters_.count("b")[0] == 2
