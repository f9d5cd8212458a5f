"""Alembic environment: the URL comes from backend.migrate, the metadata from the models."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

import backend.models  # noqa: F401  (registers every table)
from backend.extensions import connect_args, db

config = context.config
target_metadata = db.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.attributes["database_url"],
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = config.attributes["database_url"]
    engine = create_engine(url, poolclass=pool.NullPool, connect_args=connect_args(url))
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
