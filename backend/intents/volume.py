"""Settled volume per UTC day and chain, for the dashboard's chart.

Paid intents are read within the window and added up here, not grouped in SQL: a day of a ``timestamptz`` is the
session's time zone in PostgreSQL and a string prefix in SQLite, and one sum in Python is the same on both. The
read walks ``ix_intents_merchant_created`` (an intent is paid at most ``INTENT_TTL`` plus its settlement after it
was created, so ``created_at`` a day before the window bounds it) and streams the rows.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import select

from backend.extensions import db
from backend.intents.models import PAID, Intent

_intents = Intent.__table__


@dataclass(frozen=True)
class DailyVolume:
    days: list[date]  # oldest first, the last is today (UTC)
    chains: list[str]  # CAIP-2 ids with volume in the window, in the order asked for (others after, sorted)
    atomic: dict[tuple[date, str], int]  # (day, chain) -> USDC in atomic units; absent: 0

    def day_total(self, day: date) -> int:
        return sum(self.atomic.get((day, chain), 0) for chain in self.chains)

    def chain_total(self, chain: str) -> int:
        return sum(self.atomic.get((day, chain), 0) for day in self.days)


def daily_volume(merchant_id: str, now: datetime, days: int = 30, order: list[str] | None = None) -> DailyVolume:
    """The merchant's paid volume on each of the last ``days`` UTC days (today included), by chain."""
    today = now.astimezone(UTC).date()
    first = today - timedelta(days=days - 1)
    start = datetime.combine(first, time(0), tzinfo=UTC)
    query = (
        select(_intents.c.paid_at, _intents.c.chain, _intents.c.amount_atomic)
        .where(
            _intents.c.merchant_id == merchant_id,
            _intents.c.created_at >= start - timedelta(days=1),
            _intents.c.status == PAID,
            _intents.c.paid_at >= start,
        )
        .execution_options(yield_per=1000)
    )
    atomic: dict[tuple[date, str], int] = defaultdict(int)
    for paid_at, chain, amount in db.session.execute(query):
        day = paid_at.astimezone(UTC).date()
        if day <= today and chain:
            atomic[(day, chain)] += int(amount)
    seen = {chain for _, chain in atomic}
    ordered = [c for c in (order or []) if c in seen] + sorted(seen - set(order or []))
    return DailyVolume([first + timedelta(days=i) for i in range(days)], ordered, dict(atomic))
