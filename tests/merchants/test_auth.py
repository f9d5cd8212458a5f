"""Bearer authentication on every /api/v1 call."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from backend.extensions import db
from backend.merchants import services
from backend.merchants.models import ApiKey

URL = "/api/v1/x402/intents"


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Bearer sk_test_unknownkeyunknownkeyunknownkey00000",
        "Bearer pk_live_whatever",
        "Bearer " + "x" * 5000,
    ],
    ids=["missing", "empty", "no-token", "blank-token", "basic", "unknown", "wrong-prefix", "huge"],
)
def test_missing_or_unknown_key_is_401(client, merchant, header):
    headers = {"Authorization": header} if header is not None else {}
    for method, url in (("get", URL), ("post", URL), ("get", f"{URL}/x"), ("delete", f"{URL}/x")):
        response = getattr(client, method)(url, headers=headers, json={"amount_usdc": 1})
        assert response.status_code == 401, (method, url)
        body = response.get_json()
        assert body["success"] is False
        assert body["error"]["code"] == "UNAUTHORIZED"
        assert body["error"]["message"]
        assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_revoked_key_stops_working_at_once(client, merchant):
    assert client.get(URL, headers=merchant.headers).status_code == 200
    services.revoke_api_key(merchant.id, merchant.key_id)
    response = client.get(URL, headers=merchant.headers)
    assert response.status_code == 401
    assert response.get_json()["error"]["code"] == "UNAUTHORIZED"


def test_second_key_works_and_revoking_one_keeps_the_other(client, merchant):
    second = services.create_api_key(merchant.id)
    services.revoke_api_key(merchant.id, merchant.key_id)
    assert client.get(URL, headers={"Authorization": f"Bearer {second.secret}"}).status_code == 200


def test_bearer_scheme_is_case_insensitive(client, merchant):
    assert client.get(URL, headers={"Authorization": f"bearer {merchant.api_key}"}).status_code == 200


def test_last_used_at_is_kept_at_minute_precision(client, merchant, clock):
    key = lambda: db.session.scalar(select(ApiKey).where(ApiKey.id == merchant.key_id))  # noqa: E731
    assert key().last_used_at is None
    client.get(URL, headers=merchant.headers)
    db.session.expire_all()
    first = key().last_used_at
    assert first == clock.current
    clock.advance(seconds=30)
    client.get(URL, headers=merchant.headers)
    db.session.expire_all()
    assert key().last_used_at == first  # not rewritten on every call
    clock.advance(seconds=31)
    client.get(URL, headers=merchant.headers)
    db.session.expire_all()
    assert key().last_used_at == clock.current
