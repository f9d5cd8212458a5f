"""Worker jobs of the intents domain."""

from __future__ import annotations

from backend.intents import services
from backend.queueing import app_job


@app_job
def expire_intents() -> int:
    """Periodic: mark overdue pending intents expired, each with its payment.expired event."""
    return services.expire_overdue()
