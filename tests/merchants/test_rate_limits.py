"""Abuse limits on the keyed API: per key, per client IP, failed authentications; closed CORS; no caching."""

from __future__ import annotations

import dataclasses
from typing import Any

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
