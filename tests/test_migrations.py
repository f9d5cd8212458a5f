"""The same Alembic migrations build SQLite and PostgreSQL, match the models, and reverse cleanly."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import backend.models  # noqa: F401
from backend.extensions import db
from backend.migrate import current_revision, downgrade, head_revision, upgrade


def test_schema_matches_models_after_upgrade(db_url):
    assert current_revision(db_url) == head_revision()
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), db.metadata)
    engine.dispose()
    assert diff == []


def test_downgrade_and_upgrade_again(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url)
    downgrade(url, "base")
    assert current_revision(url) is None
    upgrade(url)
    assert current_revision(url) == head_revision()
