"""Run the Alembic migrations that build the schema on SQLite and PostgreSQL alike."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def current_revision(database_url: str) -> str | None:
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine, pool

    from backend.extensions import connect_args

    engine = create_engine(database_url, poolclass=pool.NullPool, connect_args=connect_args(database_url))
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


class SchemaOutOfDate(RuntimeError):
    pass


def ensure_schema(database_url: str, *, auto_upgrade: bool) -> None:
    """Upgrade (when allowed) or refuse to run against a database behind the code."""
    if current_revision(database_url) == head_revision():
        return
    if auto_upgrade:
        upgrade(database_url)
        return
    raise SchemaOutOfDate("the database schema is not up to date: run `payintent db upgrade` first")
