"""The same Alembic migrations build SQLite and PostgreSQL, match the models, and reverse cleanly."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import backend.models  # noqa: F401
from backend.extensions import db
from backend.migrate import current_revision, downgrade, head_revision, upgrade
from tests.conftest import ENGINES


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


@pytest.fixture(params=ENGINES)
def empty_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """An empty database of each engine (PostgreSQL: a schema of its own on the test server)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    base = sa.make_url(request.getfixturevalue("postgresql_url"))
    schema = f"mig_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base, poolclass=sa.pool.NullPool)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    yield base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
    admin.dispose()


def test_0009_gives_each_payee_record_the_mints_payments_landed_in(empty_url):
    """Records written before 0009 had no mint: each gets the mints of the confirmed settlements paid to its owner
    on its network (one record per mint), a record no settlement explains is dropped, and a downgrade keeps one
    record per (network, owner, genesis hash)."""
    upgrade(empty_url, "0008")
    engine = sa.create_engine(empty_url, poolclass=sa.pool.NullPool)
    now = "2026-11-24 12:00:00"
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO merchants (id, email, name, password_hash, created_at) "
            f"VALUES ('mer_x', 'x@example.com', 'X', 'hash', '{now}')"
        )
        conn.exec_driver_sql(
            "INSERT INTO intents (id, merchant_id, status, amount_atomic, metadata, payment_requirements, created_at, "
            f"updated_at, expires_at) VALUES ('int_x', 'mer_x', 'paid', 1, '{{}}', '[]', '{now}', '{now}', '{now}')"
        )
        for number, (pay_to, asset, status) in enumerate([
            ("OWNER1", "MINT_A", "confirmed"), ("OWNER1", "MINT_B", "confirmed"), ("OWNER1", "MINT_C", "failed"),
            ("OWNER2", "MINT_A", "confirmed"), ("OWNER1", "MINT_D", "confirmed"),
        ]):  # fmt: skip
            network = "solana:other" if asset == "MINT_D" else "solana:net"
            conn.exec_driver_sql(
                "INSERT INTO settlements (id, intent_id, merchant_id, network, asset, payer, pay_to, amount_atomic, "
                "valid_after, valid_before, nonce, signature, status, created_at, updated_at) VALUES "
                f"('stl_{number}', 'int_x', 'mer_x', '{network}', '{asset}', 'BUYER', '{pay_to}', 1, 0, 1, "
                f"'0x{number}', 'sig', '{status}', '{now}', '{now}')"
            )
        for owner in ("OWNER1", "OWNER2", "OWNER3"):
            conn.exec_driver_sql(
                "INSERT INTO solana_payee_accounts (network, owner, genesis_hash, created_at) "
                f"VALUES ('solana:net', '{owner}', 'G1', '{now}')"
            )
    upgrade(empty_url)
    query = "SELECT network, owner, mint, genesis_hash FROM solana_payee_accounts ORDER BY owner, mint"
    with engine.connect() as conn:
        assert [tuple(row) for row in conn.exec_driver_sql(query)] == [
            ("solana:net", "OWNER1", "MINT_A", "G1"),
            ("solana:net", "OWNER1", "MINT_B", "G1"),
            ("solana:net", "OWNER2", "MINT_A", "G1"),
        ]
    downgrade(empty_url, "0008")
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT network, owner, genesis_hash FROM solana_payee_accounts ORDER BY owner")
        assert [tuple(row) for row in rows] == [("solana:net", "OWNER1", "G1"), ("solana:net", "OWNER2", "G1")]
    engine.dispose()
