from __future__ import annotations

from decimal import Decimal

import pytest

from backend.jsonio import JSONParseError, dumps, strict_loads


def test_numbers_with_fractions_become_decimal():
    assert strict_loads('{"a": 0.1, "b": 2}') == {"a": Decimal("0.1"), "b": 2}
    assert isinstance(strict_loads("0.1"), Decimal)


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "[NaN]", "1" * 5000, "{", b"\xff", "[" * 50000])
def test_refused(raw):
    with pytest.raises(JSONParseError):
        strict_loads(raw)


def test_decimal_is_written_as_an_exact_number():
    assert dumps({"amount": Decimal("123456.789012")}) == '{"amount":123456.789012}'
    assert dumps({"amount": Decimal("0.000001")}) == '{"amount":0.000001}'
