"""The one source of "now" for the service, so tests can move time instead of sleeping."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

_now: Callable[[], datetime] = lambda: datetime.now(UTC)  # noqa: E731


def now() -> datetime:
    """Current time, timezone-aware UTC, truncated to microseconds."""
    return _now()


def set_clock(fn: Callable[[], datetime] | None) -> None:
    """Replace the clock (tests); ``None`` restores the wall clock."""
    global _now
    _now = fn if fn is not None else (lambda: datetime.now(UTC))


def isoformat(value: datetime | None) -> str | None:
    """ISO 8601 UTC with a ``Z`` suffix and millisecond precision, as the API shows times."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
