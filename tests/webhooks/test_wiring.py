"""Webhooks are wired into an app by create_app (webhooks.tasks.init_app), not at import."""

from __future__ import annotations

from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session

from backend.events import services as events
from backend.extensions import db
from backend.webhooks import tasks


def test_the_wake_up_listens_on_the_apps_session_only(app):
    assert sa_event.contains(db.session, "after_commit", tasks._wake_after_commit)
    assert sa_event.contains(db.session, "after_rollback", tasks._forget_wake)
    assert not sa_event.contains(Session, "after_commit", tasks._wake_after_commit)  # not every session


def test_init_app_twice_registers_once(app):
    tasks.init_app(app)
    tasks.init_app(app)
    assert events._subscribers.count(tasks._schedule_deliveries) == 1
