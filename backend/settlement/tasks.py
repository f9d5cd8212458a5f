"""Worker jobs of the settlement domain."""

from __future__ import annotations

from backend import appstate
from backend.queueing import app_job, app_redis
from backend.settlement.reconcile import reconcile


@app_job
def reconcile_settlements() -> dict[str, int]:
    """Periodic: finish settlements left open by crashes, timeouts or lost jobs."""
    settings = appstate.settings()
    return reconcile(
        appstate.chains(),
        app_redis(),
        settings.relayer_queue,
        chain_seconds=settings.reconcile_chain_seconds,
    )
