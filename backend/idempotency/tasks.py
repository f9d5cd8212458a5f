"""Worker jobs of the idempotency domain."""

from __future__ import annotations

from backend.idempotency import services
from backend.queueing import app_job


@app_job
def purge_idempotency_keys() -> int:
    """Periodic: forget idempotency keys older than 24 hours."""
    return services.purge_expired()
