from __future__ import annotations

import pytest

from backend.intents import export


@pytest.fixture(autouse=True)
def _exports_unlimited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests here export many times a minute; the limit has its own test (test_export.py)."""
    monkeypatch.setattr(export, "EXPORTS_PER_MINUTE", 0)
