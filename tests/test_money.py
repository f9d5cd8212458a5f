"""Amount parsing and conversion: the one place money enters the service."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.money import AmountError, from_atomic, parse_usdc_amount, to_atomic

MAX = Decimal("1000000")


@pytest.mark.parametrize(
    ("value", "atomic"),
    [
        (1, 1_000_000),
        (Decimal("10.5"), 10_500_000),
        (Decimal("0.000001"), 1),
        (Decimal("1.500000000"), 1_500_000),
        (Decimal("1E+3"), 1_000_000_000),
        (1_000_000, 1_000_000_000_000),
    ],
)
def test_valid_amounts(value, atomic):
    assert to_atomic(parse_usdc_amount(value, maximum=MAX)) == atomic


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        None,
        "1",
        1.5,
        Decimal("NaN"),
        Decimal("Infinity"),
        Decimal("-Infinity"),
        0,
        -1,
        Decimal("0"),
        Decimal("1E-7"),
        Decimal("1000000.000001"),
        Decimal("1E+999999999"),
        Decimal("1E-999999999"),
        [1],
        {"a": 1},
    ],
)
def test_invalid_amounts(value):
    with pytest.raises(AmountError):
        parse_usdc_amount(value, maximum=MAX)


@given(st.integers(min_value=1, max_value=1_000_000 * 10**6))
def test_atomic_round_trip(atomic):
    amount = from_atomic(atomic)
    assert parse_usdc_amount(amount, maximum=MAX) == amount
    assert to_atomic(amount) == atomic
    assert "E" not in str(amount)  # shown as a plain decimal number


@given(st.decimals(allow_nan=False, allow_infinity=False, places=6, min_value=Decimal("0.000001"), max_value=MAX))
def test_any_six_decimal_amount_is_exact(amount):
    assert from_atomic(to_atomic(parse_usdc_amount(amount, maximum=MAX))) == amount
