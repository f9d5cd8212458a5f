"""Formatting helpers the dashboard templates use (plain text only: templates do the escaping)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from backend import clock


def _as_datetime(value: datetime | str | None) -> datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def iso(value: datetime | str | None) -> str:
    """Machine-readable time for ``<time datetime=...>``."""
    moment = _as_datetime(value)
    return clock.isoformat(moment) or ""


def human(value: datetime | str | None) -> str:
    """``2026-11-22 12:00:05 UTC`` (or an em dash for none)."""
    moment = _as_datetime(value)
    if moment is None:
        return "\u2014"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def usdc(amount: Decimal | int | None) -> str:
    """``1,234.5 USDC``: exact, grouped, never a float."""
    if amount is None:
        return "\u2014"
    return f"{Decimal(amount):,} USDC"


@dataclass(frozen=True)
class Pager:
    page: int
    page_size: int
    total: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.page_size))

    @property
    def first_item(self) -> int:
        return 0 if self.total == 0 else (self.page - 1) * self.page_size + 1

    @property
    def last_item(self) -> int:
        return min(self.total, self.page * self.page_size)

    @property
    def has_previous(self) -> bool:
        return self.page > 1

    @property
    def has_next(self) -> bool:
        return self.page < self.pages
