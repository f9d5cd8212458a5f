"""Properties of amount parsing (``backend.money``), for any input hypothesis can think of.

Money enters as a JSON number, parsed by ``jsonio.strict_loads`` into ``int`` or ``Decimal``; it
leaves as atomic units (an ``int``) and comes back as a ``Decimal``. Never a float, never a crash.
"""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from backend.jsonio import strict_loads
from backend.money import ATOMIC_PER_USDC, AmountError, from_atomic, parse_usdc_amount, to_atomic

MAX = Decimal("1000000")
MAX_ATOMIC = int(MAX) * ATOMIC_PER_USDC
atomic_amounts = st.integers(min_value=1, max_value=MAX_ATOMIC)


def parse(value: object, maximum: Decimal = MAX) -> Decimal:
    return parse_usdc_amount(value, maximum=maximum)


@given(atomic_amounts)
def test_atomic_units_round_trip_through_decimal(atomic):
    amount = from_atomic(atomic)
    assert type(amount) is Decimal
    assert parse(amount) == amount and to_atomic(parse(amount)) == atomic
    assert to_atomic(amount) == atomic and type(to_atomic(amount)) is int
    assert "E" not in str(amount) and "e" not in str(amount)  # written as a plain number


@given(atomic_amounts, st.integers(min_value=0, max_value=30))
def test_every_spelling_of_the_same_amount_is_the_same_amount(atomic, extra_zeros):
    # 1.5, 1.500000000, 15E-1, 0.15E+1: one value, so one amount and one count of atomic units.
    digits = str(atomic * 10**extra_zeros)
    plain = format(from_atomic(atomic), "f")
    spellings = [
        f"{digits}E-{6 + extra_zeros}",
        (plain if "." in plain or not extra_zeros else plain + ".") + "0" * extra_zeros,
        f"0.{digits}E{len(digits) - 6 - extra_zeros:+d}",
    ]
    for text in spellings:
        value = strict_loads(text)
        assert value == from_atomic(atomic), text
        assert to_atomic(parse(value)) == atomic, text


@given(st.integers(min_value=1, max_value=10**40), st.integers(min_value=7, max_value=40))
def test_more_than_six_decimals_are_refused(digits, places):
    amount = Decimal(digits).scaleb(-places)
    assume(digits % 10 ** (places - 6) != 0)  # a real 7th+ decimal, not trailing zeros
    with pytest.raises(AmountError):
        parse(amount)


@given(st.one_of(st.integers(max_value=0), st.decimals(max_value=0, allow_nan=False, allow_infinity=False)))
@example(Decimal("-0"))
@example(Decimal("-0E+5"))
def test_zero_and_negatives_are_refused(value):
    with pytest.raises(AmountError, match="greater than 0"):
        parse(value)


@given(st.sampled_from(["NaN", "-NaN", "sNaN", "-sNaN", "Infinity", "-Infinity", "NaN123"]))
def test_nan_and_infinities_are_refused(text):
    with pytest.raises(AmountError):
        parse(Decimal(text))


@given(st.one_of(st.floats(), st.text(), st.booleans(), st.none(), st.lists(st.integers(), max_size=2)))
def test_only_int_and_decimal_are_amounts_never_a_float(value):
    with pytest.raises(AmountError, match="JSON number"):
        parse(value)


@given(
    st.decimals(min_value=Decimal("0.000001"), max_value=Decimal("1E+12"), places=6),
    st.decimals(min_value=Decimal("0.000001"), max_value=Decimal("1E+12"), places=6),
)
def test_the_maximum_is_inclusive_and_enforced(amount, maximum):
    if amount <= maximum:
        assert parse(amount, maximum) == amount
    else:
        with pytest.raises(AmountError, match="at most"):
            parse(amount, maximum)


@given(st.one_of(st.integers(), st.decimals()))
@example(Decimal("1E+999999999"))
@example(Decimal("1E-999999999"))
@example(Decimal("999999.9999999999999999999999999999"))
def test_any_number_is_refused_or_an_exact_atomic_amount(value):
    try:
        amount = parse(value)
    except AmountError:
        return
    assert type(amount) is Decimal and 0 < amount <= MAX
    assert amount == value  # never rounded
    assert from_atomic(to_atomic(amount)) == amount


@given(st.decimals(allow_nan=False, allow_infinity=False))
def test_json_numbers_are_parsed_exactly_never_through_a_float(number):
    text = json.dumps({"amount_usdc": "PLACEHOLDER"}).replace('"PLACEHOLDER"', str(number))
    value = strict_loads(text)["amount_usdc"]
    assert type(value) in (int, Decimal) and value == number
    try:
        amount = parse(value)
    except AmountError:
        return
    assert amount == number
