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


def _insert_settlement_0009(conn: Any, number: int, network: str, status: str, valid_after: int, valid_before: int,
                            signature: str, payer: str = "BUYER") -> None:  # fmt: skip
    now = "2026-11-24 12:00:00"
    conn.execute(
        sa.text(
            "INSERT INTO settlements (id, intent_id, merchant_id, network, asset, payer, pay_to, amount_atomic, "
            "valid_after, valid_before, nonce, signature, status, created_at, updated_at) VALUES (:id, 'int_x', "
            "'mer_x', :network, 'ASSET', :payer, 'PAYEE', 1000000, :valid_after, :valid_before, :nonce, :signature, "
            ":status, :now, :now)"
        ),
        {"id": f"stl_{number}", "network": network, "payer": payer, "valid_after": valid_after,
         "valid_before": valid_before, "nonce": "0x" + f"{number:02x}" * 32, "signature": signature,
         "status": status, "now": now},
    )  # fmt: skip


def _merchant_and_intent(conn: Any) -> None:
    now = "2026-11-24 12:00:00"
    conn.exec_driver_sql(
        "INSERT INTO merchants (id, email, name, password_hash, created_at) "
        f"VALUES ('mer_x', 'x@example.com', 'X', 'hash', '{now}')"
    )
    conn.exec_driver_sql(
        "INSERT INTO intents (id, merchant_id, status, amount_atomic, metadata, payment_requirements, created_at, "
        f"updated_at, expires_at) VALUES ('int_x', 'mer_x', 'pending', 1, '{{}}', '[]', '{now}', '{now}', '{now}')"
    )


def test_0010_moves_each_rows_terms_to_its_rails_columns_and_back(empty_url):
    """Rows written before 0010 (a Solana row kept its block height in valid_before, its transaction in signature
    and 0 in valid_after) read as their rail's typed terms after it: an open Solana row is still settleable (the
    relayer's reads: its transaction passes the relay's checks, its height decides whether it may still land), and an
    EVM row's authorization is unchanged. A downgrade puts the old values back."""
    from solders.hash import Hash
    from solders.keypair import Keypair

    from backend.rails.evm.terms import EvmTerms
    from backend.rails.registry import rail_of_kind
    from backend.rails.solana.rail import SolanaTerms
    from backend.settlement.models import Settlement, settlement_terms
    from payintent import solana_tx as stx

    relay, buyer, payee, mint = Keypair(), Keypair(), Keypair(), Keypair()
    unsigned = stx.build_payment(
        fee_payer=str(relay.pubkey()), payer=str(buyer.pubkey()), mint=str(mint.pubkey()),
        pay_to=str(payee.pubkey()), amount_atomic=1_000_000, intent_id="int_x", recent_blockhash=str(Hash.new_unique()),
    )  # fmt: skip
    transaction = stx.encode(stx.sign_as(unsigned, buyer))
    evm_signature = "0x" + "ab" * 65
    upgrade(empty_url, "0009")
    engine = sa.create_engine(empty_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        _merchant_and_intent(conn)
        _insert_settlement_0009(conn, 1, "eip155:84532", "submitted", 1_700_000_000, 1_700_000_900, evm_signature,
                                payer="0x" + "11" * 20)  # fmt: skip
        _insert_settlement_0009(conn, 2, "solana:net", "pending", 0, 5_300, transaction, payer=str(buyer.pubkey()))
    upgrade(empty_url)
    with sa.orm.Session(engine) as session:
        evm_row, solana_row = session.get(Settlement, "stl_1"), session.get(Settlement, "stl_2")
        assert evm_row is not None and solana_row is not None
        assert (solana_row.valid_after, solana_row.valid_before, solana_row.signature) == (None, None, None)
        assert (evm_row.last_valid_block_height, evm_row.signed_transaction) == (None, None)
        evm_terms, solana_terms = settlement_terms(evm_row), settlement_terms(solana_row)
    assert isinstance(evm_terms, EvmTerms)
    assert (evm_terms.payer, evm_terms.pay_to, evm_terms.value, evm_terms.valid_after, evm_terms.valid_before,
            evm_terms.nonce, evm_terms.signature_hex) == (
        "0x" + "11" * 20, "PAYEE", 1_000_000, 1_700_000_000, 1_700_000_900, b"\x01" * 32, evm_signature)  # fmt: skip
    assert solana_terms == SolanaTerms(
        payer=str(buyer.pubkey()), pay_to="PAYEE", value=1_000_000, last_valid_block_height=5_300,
        nonce_hex="0x" + "02" * 32, transaction=transaction,
    )  # fmt: skip
    # What the relay does with an open Solana row before co-signing (rails/solana/relay.py submit).
    assert isinstance(solana_terms, SolanaTerms)
    solana = rail_of_kind("solana")
    assert solana.may_still_execute(solana_terms, 5_300) and not solana.may_still_execute(solana_terms, 5_301)
    expected = {"asset": str(mint.pubkey()), "payTo": str(payee.pubkey()), "maxAmountRequired": 1_000_000}
    payment = stx.check_payment(stx.decode(solana_terms.transaction), expected, "int_x", str(relay.pubkey()))
    assert payment.payer == str(buyer.pubkey()) and payment.amount_atomic == 1_000_000
    downgrade(empty_url, "0009")
    query = "SELECT id, valid_after, valid_before, signature FROM settlements ORDER BY id"
    with engine.connect() as conn:
        assert [tuple(row) for row in conn.exec_driver_sql(query)] == [
            ("stl_1", 1_700_000_000, 1_700_000_900, evm_signature),
            ("stl_2", 0, 5_300, transaction),
        ]
    upgrade(empty_url)  # and up again
    with sa.orm.Session(engine) as session:
        row = session.get(Settlement, "stl_2")
        assert row is not None and settlement_terms(row) == solana_terms
    engine.dispose()


@pytest.mark.parametrize(
    ("network", "columns"),
    [
        ("solana:net", {"valid_after": 0, "valid_before": 1, "signature": "tx"}),  # the old form
        ("solana:net", {"valid_after": 0, "last_valid_block_height": 1, "signed_transaction": "tx"}),
        ("solana:net", {"last_valid_block_height": 1}),
        ("eip155:1", {"last_valid_block_height": 1, "signed_transaction": "tx"}),
        ("eip155:1", {"valid_after": 0, "valid_before": 1}),
        ("other:1", {"valid_after": 0, "valid_before": 1, "signature": "0x"}),
    ],
)
def test_0010_each_row_has_exactly_its_rails_columns(empty_url, network, columns):
    upgrade(empty_url)
    engine = sa.create_engine(empty_url, poolclass=sa.pool.NullPool)
    names = ", ".join(columns)
    values = ", ".join(f":{name}" for name in columns)
    insert = sa.text(
        f"INSERT INTO settlements (id, intent_id, merchant_id, network, asset, payer, pay_to, amount_atomic, nonce, "
        f"status, created_at, updated_at, {names}) VALUES ('stl_1', 'int_x', 'mer_x', :network, 'A', 'P', 'Q', 1, "
        f"'0x01', 'pending', '2026-11-24 12:00:00', '2026-11-24 12:00:00', {values})"
    )
    with engine.begin() as conn:
        _merchant_and_intent(conn)
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(insert, {"network": network, **columns})
    engine.dispose()


def test_0010s_check_is_the_models():
    """The migration's CHECK is the text the model builds from the rails (a new rail changes both)."""
    import importlib.util
    from pathlib import Path

    from backend.settlement.models import Settlement

    path = Path(__file__).parents[1] / "backend/migrations/versions/0010_settlement_terms_per_rail.py"
    spec = importlib.util.spec_from_file_location("migration_0010", path)
    assert spec is not None and spec.loader is not None
    migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migration)
    checks = [c for c in Settlement.__table__.constraints if isinstance(c, sa.CheckConstraint)]
    assert [(c.name, str(c.sqltext)) for c in checks] == [("ck_settlements_terms_of_rail", migration.TERMS_OF_RAIL)]


def test_0011_adds_relay_nonce_null_on_old_rows_and_a_downgrade_keeps_the_rows(empty_url):
    """Rows written before 0011 have no relay nonce (NULL); a large nonce fits (BigInteger); a downgrade drops the
    column and keeps every row, and upgrading again gives NULL."""
    upgrade(empty_url, "0010")
    engine = sa.create_engine(empty_url, poolclass=sa.pool.NullPool)
    insert = sa.text(
        "INSERT INTO settlements (id, intent_id, merchant_id, network, asset, payer, pay_to, amount_atomic, nonce, "
        "status, created_at, updated_at, valid_after, valid_before, signature, tx_hash, relay_address) VALUES "
        "(:id, 'int_x', 'mer_x', 'eip155:84532', 'A', 'P', 'Q', 1, :nonce, 'submitted', '2026-11-24 12:00:00', "
        "'2026-11-24 12:00:00', 0, 1, '0x', '0xhash', '0xrelay')"
    )
    with engine.begin() as conn:
        _merchant_and_intent(conn)
        conn.execute(insert, {"id": "stl_1", "nonce": "0x01"})
    upgrade(empty_url)
    with engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT relay_nonce FROM settlements").scalar_one() is None
        conn.execute(insert, {"id": "stl_2", "nonce": "0x02"})
        conn.exec_driver_sql(f"UPDATE settlements SET relay_nonce = {2**40} WHERE id = 'stl_2'")
        rows = conn.exec_driver_sql("SELECT id, relay_nonce FROM settlements ORDER BY id")
        assert [tuple(row) for row in rows] == [("stl_1", None), ("stl_2", 2**40)]
    downgrade(empty_url, "0010")
    with engine.connect() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("settlements")}
        assert "relay_nonce" not in columns
        rows = conn.exec_driver_sql("SELECT id, tx_hash, relay_address FROM settlements ORDER BY id")
        assert [tuple(row) for row in rows] == [("stl_1", "0xhash", "0xrelay"), ("stl_2", "0xhash", "0xrelay")]
    upgrade(empty_url)
    with engine.connect() as conn:
        assert [r[0] for r in conn.exec_driver_sql("SELECT relay_nonce FROM settlements")] == [None, None]
    engine.dispose()


def test_0012_keeps_a_duplicate_open_relay_nonce_on_the_newest_row_only(empty_url, caplog):
    """The relay before 0012 could record one (account, nonce) on two open settlements: the upgrade keeps it on the
    most recently submitted one, clears it (NULL) on the other, leaves closed rows alone, then builds the index,
    which refuses a new duplicate."""
    upgrade(empty_url, "0011")
    engine = sa.create_engine(empty_url, poolclass=sa.pool.NullPool)
    insert = sa.text(
        "INSERT INTO settlements (id, intent_id, merchant_id, network, asset, payer, pay_to, amount_atomic, nonce, "
        "status, created_at, updated_at, submitted_at, valid_after, valid_before, signature, tx_hash, relay_address, "
        "relay_nonce) VALUES (:id, 'int_x', 'mer_x', 'eip155:84532', 'A', 'P', 'Q', 1, :id, :status, "
        "'2026-11-24 12:00:00', :at, :at, 0, 1, '0x', :id, :relay, 7)"
    )
    with engine.begin() as conn:
        _merchant_and_intent(conn)
        for settlement_id, status, at, relay in [
            ("stl_a", "submitted", "2026-11-24 12:05:00", "0xrelay"),  # newest open: keeps 7
            ("stl_b", "submitted", "2026-11-24 12:01:00", "0xrelay"),  # older open: cleared
            ("stl_c", "confirmed", "2026-11-24 12:09:00", "0xrelay"),  # closed: kept, outside the index
            ("stl_d", "submitted", "2026-11-24 12:00:00", "0xRELAY"),  # the same account in another case: cleared
            ("stl_e", "submitted", "2026-11-24 12:00:00", "0xother"),  # another account: kept
        ]:  # fmt: skip
            conn.execute(insert, {"id": settlement_id, "status": status, "at": at, "relay": relay})
    with caplog.at_level("WARNING", logger="backend.migrations.0012"):
        upgrade(empty_url)
    assert current_revision(empty_url) == head_revision()
    assert "stl_b" in caplog.text and "stl_d" in caplog.text and "stl_a" not in caplog.text
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT id, relay_nonce FROM settlements ORDER BY id")
        assert [tuple(row) for row in rows] == [
            ("stl_a", 7), ("stl_b", None), ("stl_c", 7), ("stl_d", None), ("stl_e", 7)
        ]  # fmt: skip
        listed = (  # expression indexes: SQLAlchemy's inspector skips them on SQLite
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'settlements'"
            if conn.dialect.name == "sqlite"
            else "SELECT indexname FROM pg_indexes WHERE tablename = 'settlements'"
        )
        indexes = set(conn.exec_driver_sql(listed).scalars())
        assert {"uq_settlements_open_relay_nonce", "ix_settlements_relay_nonce"} <= indexes
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.exec_driver_sql("UPDATE settlements SET relay_nonce = 7 WHERE id = 'stl_b'")
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:  # "0xRELAY" is "0xrelay"
        conn.exec_driver_sql("UPDATE settlements SET relay_nonce = 7 WHERE id = 'stl_d'")
    with engine.begin() as conn:  # a closed row may still share it
        conn.exec_driver_sql("UPDATE settlements SET relay_nonce = 7, status = 'failed' WHERE id = 'stl_b'")
    engine.dispose()
