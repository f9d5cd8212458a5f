"""Worker jobs of the dashboard."""

from __future__ import annotations

from backend.dashboard import reveals
from backend.queueing import app_job


@app_job
def purge_expired_reveals() -> int:
    """Periodic: delete secrets that were never shown in time (an abandoned tab, a closed browser)."""
    return reveals.purge_expired()
