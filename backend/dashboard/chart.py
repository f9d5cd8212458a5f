"""The overview's volume chart: stacked bars per day and chain, drawn as inline SVG on the server.

No script and no CDN: the template writes the shapes computed here (``volume_chart``), and a table of the same
numbers goes with it for screen readers and for anyone who wants the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from backend.intents.volume import DailyVolume
from backend.money import from_atomic

WIDTH, HEIGHT = 720, 240
LEFT, RIGHT, TOP, BOTTOM = 72, 8, 12, 28  # room for the axis labels
# Distinguishable, and each at least 4.5:1 against the white card (WCAG AA for the legend's text swatches).
PALETTE = ("#1d4ed8", "#b45309", "#047857", "#7c3aed", "#be123c", "#0e7490")


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    color: str
    title: str  # the tooltip: day, chain, amount


@dataclass(frozen=True)
class Series:
    chain: str
    name: str
    color: str
    total: Decimal


@dataclass(frozen=True)
class Row:
    day: str
    amounts: list[Decimal]  # per series, in the legend's order
    total: Decimal


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    plot_left: int
    plot_bottom: int
    bars: list[Bar]
    y_ticks: list[tuple[float, str]]
    x_ticks: list[tuple[float, str]]
    series: list[Series]
    rows: list[Row]
    total: Decimal
    first_day: str
    last_day: str


def _nice_ceiling(value: Decimal) -> Decimal:
    """The smallest 1, 2 or 5 times a power of ten that is at least ``value`` (> 0)."""
    step = Decimal(1).scaleb(value.adjusted())
    for factor in (1, 2, 5, 10):
        if value <= step * factor:
            return step * factor
    return step * 10  # unreachable: value < 10 * step


def _usdc(value: Decimal) -> str:
    return f"{value.normalize():,f}"


def volume_chart(volume: DailyVolume, names: dict[str, str]) -> Chart:
    series = [
        Series(chain, names.get(chain, chain), PALETTE[i % len(PALETTE)], from_atomic(volume.chain_total(chain)))
        for i, chain in enumerate(volume.chains)
    ]
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    peak = max((volume.day_total(day) for day in volume.days), default=0)
    top = _nice_ceiling(from_atomic(peak)) if peak else Decimal(1)
    slot = plot_width / len(volume.days)
    bars: list[Bar] = []
    rows: list[Row] = []
    for i, day in enumerate(volume.days):
        base = float(HEIGHT - BOTTOM)
        amounts = []
        for s in series:
            amount = from_atomic(volume.atomic.get((day, s.chain), 0))
            amounts.append(amount)
            if amount:
                height = float(amount / top) * plot_height
                base -= height
                title = f"{day.isoformat()} · {s.name}: {_usdc(amount)} USDC"
                bars.append(Bar(LEFT + i * slot + slot * 0.15, base, slot * 0.7, height, s.color, title))
        rows.append(Row(day.isoformat(), amounts, sum(amounts, Decimal(0))))
    y_ticks = [(float(HEIGHT - BOTTOM - plot_height * k / 2), _usdc(top * k / 2)) for k in range(3)]
    x_ticks = [(LEFT + i * slot + slot / 2, volume.days[i].strftime("%b %d")) for i in range(0, len(volume.days), 7)]
    return Chart(
        WIDTH, HEIGHT, LEFT, HEIGHT - BOTTOM, bars, y_ticks, x_ticks, series, rows,
        sum((s.total for s in series), Decimal(0)), volume.days[0].isoformat(), volume.days[-1].isoformat(),
    )  # fmt: skip
