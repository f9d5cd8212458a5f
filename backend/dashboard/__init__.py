"""The merchant dashboard: server-rendered pages at ``/dashboard`` (see ``views``)."""

from __future__ import annotations

from flask import Flask


def init_app(app: Flask) -> None:
    """Register the dashboard and configure the session cookie it logs merchants in with.

    Sessions are used by the dashboard only: HttpOnly, SameSite=Lax, Secure on https requests,
    signed with SECRET_KEY, valid 12 hours after log-in.
    """
    # Here, not at the top: importing backend.dashboard.models (alembic, backend.models) loads no views.
    from backend.dashboard import (
        links,  # noqa: F401 - registers the payment links pages on bp
        refunds,  # noqa: F401 - registers the refund pages on bp
        wallets,  # noqa: F401 - registers the wallet proof routes on bp
    )
    from backend.dashboard.security import SESSION_MAX_AGE, DashboardSessionInterface
    from backend.dashboard.views import bp

    app.config.update(
        SESSION_COOKIE_NAME="payintent_session",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        PERMANENT_SESSION_LIFETIME=SESSION_MAX_AGE,
    )
    app.session_interface = DashboardSessionInterface()
    app.register_blueprint(bp)
