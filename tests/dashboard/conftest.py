from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import MerchantHandle
from tests.dashboard.helpers import log_in


@pytest.fixture
def dashboard(client: Any, merchant: MerchantHandle) -> Any:
    """A test client logged in to the dashboard as ``merchant``."""
    response = log_in(client, "shop@example.com")
    assert response.status_code == 302, response.data
    return client


@pytest.fixture(autouse=True)
def _exports_unlimited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests here export many times a minute (the limit's own test: tests/intents/test_export.py)."""
    from backend.intents import export

    monkeypatch.setattr(export, "EXPORTS_PER_MINUTE", 0)
