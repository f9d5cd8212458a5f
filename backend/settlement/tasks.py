"""Worker jobs of the settlement domain."""

from __future__ import annotations

from flask import current_app

from backend.queueing import app_job, redis_from_url
from backend.settlement.reconcile import reconcile


@app_job
def reconcile_settlements() -> dict[str, int]:
    """Periodic: finish settlements left open by crashes, timeouts or lost jobs."""
    settings = current_app.config["PAYINTENT_SETTINGS"]
    redis = redis_from_url(settings.redis_url) if settings.redis_url else None
    return reconcile(current_app.extensions["payintent.chains"], redis, settings.relayer_queue)
