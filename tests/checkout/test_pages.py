"""The checkout page's files: one index.html for every /pay/<id>, hashed assets, strict headers."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import make_settings


@pytest.fixture
def built(tmp_path) -> Any:
    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text('<!doctype html><div id="app"></div><script src="/pay/assets/app-1a2b.js">')
    (tmp_path / "assets" / "app-1a2b.js").write_text("console.log('checkout')")
    return tmp_path


def page_client(db_url: str, chains: Any, dist: Any) -> Any:
    from backend.app import create_app

    return create_app(make_settings(db_url, checkout_dist_dir=str(dist)), chains=chains).test_client()


def test_every_intent_gets_the_page_with_a_strict_policy(db_url, chains, built):
    client = page_client(db_url, chains, built)
    for intent_id in ("2f1e5c1a-5d55-4a8e-9d7e-3c1f7f0b2a10", "not-an-intent"):  # the page says "not found"
        response = client.get(f"/pay/{intent_id}")
        assert response.status_code == 200 and 'id="app"' in response.get_data(as_text=True)
        assert response.headers["Cache-Control"] == "no-cache"
        policy = response.headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert response.headers["Referrer-Policy"] == "no-referrer"  # the intent id must not leak to other sites
    asset = client.get("/pay/assets/app-1a2b.js")
    assert asset.status_code == 200 and asset.get_data(as_text=True) == "console.log('checkout')"
    assert "immutable" in asset.headers["Cache-Control"]
    assert client.get("/pay/assets/missing.js").status_code == 404
    assert client.get("/pay/assets/../index.html").status_code == 404


def test_an_unbuilt_page_says_how_to_build_it(db_url, chains, tmp_path):
    response = page_client(db_url, chains, tmp_path / "nothing").get("/pay/2f1e5c1a-5d55-4a8e-9d7e-3c1f7f0b2a10")
    assert response.status_code == 503 and "make install" in response.get_data(as_text=True)
