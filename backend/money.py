"""USDC amounts: the one place that parses, bounds and converts them.

USDC has 6 decimals on every supported network. Amounts are ``Decimal`` in USDC or ``int``
atomic units (1 USDC = 1_000_000); never ``float``.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

USDC_DECIMALS = 6
ATOMIC_PER_USDC = 10**USDC_DECIMALS
_QUANTUM = Decimal(1).scaleb(-USDC_DECIMALS)  # 0.000001


class AmountError(ValueError):
    """An amount that the service refuses; the message is safe to show to API callers."""


def parse_usdc_amount(value: object, *, maximum: Decimal) -> Decimal:
    """Validate a JSON-decoded amount and return it as an exact ``Decimal``.

    Accepts JSON numbers only (``int`` or ``Decimal`` from the strict JSON parser): not strings,
    booleans, floats, NaN or infinities. The amount must be > 0, at most ``maximum`` and have at
    most 6 decimal places.
    """
    if isinstance(value, bool) or not isinstance(value, int | Decimal):
        raise AmountError("must be a JSON number (for example 10.5)")
    amount = Decimal(value)
    if not amount.is_finite():
        raise AmountError("must be a finite number")
    if amount <= 0:
        raise AmountError("must be greater than 0")
    if amount > maximum:
        raise AmountError(f"must be at most {maximum}")
    try:
        quantized = amount.quantize(_QUANTUM)
    except InvalidOperation:
        raise AmountError("is not a valid amount") from None
    if quantized != amount:
        raise AmountError(f"must have at most {USDC_DECIMALS} decimal places")
    return quantized


def to_atomic(amount: Decimal) -> int:
    """USDC ``Decimal`` to integer atomic units; the amount must already be validated."""
    atomic = amount.scaleb(USDC_DECIMALS)
    if atomic != atomic.to_integral_value():
        raise AmountError(f"must have at most {USDC_DECIMALS} decimal places")
    return int(atomic)


def from_atomic(atomic: int) -> Decimal:
    """Integer atomic units to a normalised USDC ``Decimal`` (``10000000`` -> ``10``)."""
    value = Decimal(atomic).scaleb(-USDC_DECIMALS)
    # normalize() would print 1E+1 for 10; quantize to an integer exponent when whole.
    if value == value.to_integral_value():
        return value.quantize(Decimal(1))
    return value.normalize()
