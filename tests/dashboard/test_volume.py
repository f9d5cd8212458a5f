"""The overview's volume chart: settled USDC per UTC day and chain over 30 days, as inline SVG and a table."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import update

from backend import clock
from backend.dashboard.chart import _nice_ceiling, volume_chart
from backend.extensions import db
from backend.intents.models import Intent
from backend.intents.volume import daily_volume
from tests.dashboard.helpers import text
from tests.intents.helpers import create


def _paid(client, merchant, amount: str, chain: str, at: datetime) -> None:
    intent = create(client, merchant, amount_usdc=Decimal(amount))
    db.session.execute(
        update(Intent)
        .where(Intent.id == intent["intent_id"])
        .values(status="paid", chain=chain, paid_at=at, created_at=at - timedelta(minutes=5), tx_hash="0x" + "ab" * 32)
    )
    db.session.commit()


def test_volume_is_summed_per_utc_day_and_chain_over_the_last_30_days(client, merchant, other_merchant):
    now = clock.now()
    today = now.astimezone(UTC).date()
    noon = datetime.combine(today, datetime.min.time(), tzinfo=UTC) + timedelta(hours=12)
    _paid(client, merchant, "1.5", "eip155:84532", noon - timedelta(days=1))
    _paid(client, merchant, "2.25", "eip155:84532", noon - timedelta(days=1, hours=1))
    _paid(client, merchant, "0.000001", "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", noon - timedelta(days=29))
    _paid(client, merchant, "7", "eip155:84532", noon - timedelta(days=30))  # before the window
    _paid(client, other_merchant, "100", "eip155:84532", noon - timedelta(days=1))  # someone else's
    create(client, merchant, amount_usdc=Decimal("9"))  # pending: not volume
    volume = daily_volume(merchant.id, now, 30, order=["eip155:84532", "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"])
    assert volume.days[-1] == today and len(volume.days) == 30
    yesterday = today - timedelta(days=1)
    assert volume.atomic == {
        (yesterday, "eip155:84532"): 3_750_000,
        (today - timedelta(days=29), "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"): 1,
    }
    assert volume.chains == ["eip155:84532", "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"]
    chart = volume_chart(volume, {"eip155:84532": "Base Sepolia"})
    assert [(s.name, s.total) for s in chart.series] == [
        ("Base Sepolia", Decimal("3.75")),
        ("solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", Decimal("0.000001")),
    ]
    assert chart.total == Decimal("3.750001")
    assert chart.y_ticks[-1][1] == "5"  # the tallest day (3.75) under a round top
    tallest = max(chart.bars, key=lambda bar: bar.height)
    assert "Base Sepolia: 3.75 USDC" in tallest.title and yesterday.isoformat() in tallest.title
    assert round(tallest.height / (chart.plot_bottom - 12), 3) == round(3.75 / 5, 3)


def test_round_tops():
    assert [_nice_ceiling(Decimal(v)) for v in ("0.000001", "0.3", "1", "3.75", "11", "999999")] == [
        Decimal("0.000001"), Decimal("0.5"), Decimal("1"), Decimal("5"), Decimal("20"), Decimal("1000000"),
    ]  # fmt: skip


def test_the_overview_draws_the_chart_and_its_table(client, merchant, dashboard):
    assert "No payments settled in the last 30 days yet" in text(dashboard.get("/dashboard/"))
    _paid(client, merchant, "12.5", "eip155:84532", clock.now() - timedelta(hours=1))
    page = text(dashboard.get("/dashboard/"))
    svg = re.search(r"<svg viewBox=[^>]*role=\"img\".*?</svg>", page, re.S)
    assert svg is not None
    assert "<script" not in page and "style=" not in svg.group(0)  # no script, nothing the CSP would block
    assert len(re.findall(r"<rect x=", svg.group(0))) == 1
    assert "12.5 USDC" in svg.group(0)
    assert re.search(r"<th scope=\"row\">\d{4}-\d\d-\d\d</th><td class=\"num\">12.5 USDC</td>", page)
