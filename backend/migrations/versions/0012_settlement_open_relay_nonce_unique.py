"""one open settlement per (network, relay_address, relay_nonce): a partial unique index over the open rows (status
pending or submitted, relay_nonce set), so the database record of a relay transaction's nonce is fenced even when
two relayer processes believe they own the account (a lease lost unseen): the second record fails before its
broadcast (docs/architecture.md, "The pipelined EVM relay"). Closed rows keep their nonces without a constraint.
The relay account is indexed as ``lower(relay_address)``, as ``max_relay_nonce`` compares it, so
an address recorded in another case is the same account. A second index, (network, lower(relay_address),
relay_nonce) over every row, serves ``max_relay_nonce`` (each account's start, and the adoption's look at every free
account every ADOPT_SECONDS), which otherwise read every settlement. Downgrade drops both (and gives no cleared nonce
back).

The relay before this revision recorded the node's pending count as the nonce before broadcasting, so after a
timeout, a dropped transaction or a crash after the record the next send could take that nonce again: open rows
sharing a triple exist in real databases, and the index could not be built over them. So, before it is, each such
group (compared as the index compares: exact network, relay_address whatever its case, relay_nonce set) keeps
relay_nonce on its most recently submitted row (latest submitted_at, then updated_at, then the highest id): it was
sent when the node's pending count said the nonce was free, i.e. the earlier transaction was not held there. The
others get relay_nonce NULL, logged by id (a warning on stderr). NULL is the pre-0011 "nonce unknown" state, which
the relay handles: the watch (backend/rails/evm/watch.py) keeps a transaction PENDING while the node knows it, and
without a recorded nonce calls an unknown one UNKNOWN, so ``_send_again`` (sender.py) sends the settlement again at
a new nonce; if the earlier transaction is still mined somewhere, EIP-3009 executes the authorization once and the
second reverts harmlessly (the outcome is read from the chain). ``max_relay_nonce`` (backend/settlement/services.py)
is unchanged: the kept row holds the same nonce. Stop the old relayers before migrating (docs/deploy.md).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 10:10:00
"""

import logging

import sqlalchemy as sa
from alembic import context, op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

OPEN_WITH_NONCE = sa.text("status IN ('pending', 'submitted') AND relay_nonce IS NOT NULL")
# The relay account whatever the case of its hex, as max_relay_nonce compares it (an index on the expression).
RELAY_ACCOUNT = sa.text("lower(relay_address)")

# Not under "alembic": its package logger has a NullHandler, which would swallow these (no stderr fallback).
log = logging.getLogger("backend.migrations.0012")

# Every open row in a group of open rows sharing (network, relay_address, relay_nonce), newest first in its group.
_DUPLICATES = sa.text(
    "SELECT s.id, s.network, s.relay_address, s.relay_nonce FROM settlements s JOIN ("
    "SELECT network, lower(relay_address) AS relay, relay_nonce FROM settlements "
    "WHERE status IN ('pending', 'submitted') AND relay_nonce IS NOT NULL "
    "GROUP BY network, lower(relay_address), relay_nonce HAVING COUNT(*) > 1"
    ") d ON s.network = d.network AND lower(s.relay_address) = d.relay AND s.relay_nonce = d.relay_nonce "
    "WHERE s.status IN ('pending', 'submitted') "
    "ORDER BY s.network, lower(s.relay_address), s.relay_nonce, "
    "CASE WHEN s.submitted_at IS NULL THEN 1 ELSE 0 END, s.submitted_at DESC, s.updated_at DESC, s.id DESC"
)
_CLEAR = sa.text("UPDATE settlements SET relay_nonce = NULL WHERE id IN :ids").bindparams(
    sa.bindparam("ids", expanding=True)
)


def _clear_duplicate_open_nonces() -> None:
    """relay_nonce NULL on every open row but the newest of its (network, relay_address, relay_nonce) group."""
    bind = op.get_bind()
    kept: set[tuple[str, str, int]] = set()
    cleared: list[str] = []
    for settlement_id, network, relay_address, relay_nonce in bind.execute(_DUPLICATES).all():
        triple = (network, relay_address.lower(), int(relay_nonce))
        if triple in kept:
            cleared.append(settlement_id)
            log.warning("settlement %s: relay_nonce %s of %s on %s cleared (NULL): a newer open settlement "
                        "recorded the same nonce", settlement_id, relay_nonce, relay_address, network)  # fmt: skip
        else:
            kept.add(triple)
    for start in range(0, len(cleared), 500):
        bind.execute(_CLEAR, {"ids": cleared[start : start + 500]})


def upgrade() -> None:
    if not context.is_offline_mode():
        _clear_duplicate_open_nonces()
    op.create_index(
        "uq_settlements_open_relay_nonce",
        "settlements",
        ["network", RELAY_ACCOUNT, "relay_nonce"],
        unique=True,
        sqlite_where=OPEN_WITH_NONCE,
        postgresql_where=OPEN_WITH_NONCE,
    )
    op.create_index("ix_settlements_relay_nonce", "settlements", ["network", RELAY_ACCOUNT, "relay_nonce"])


def downgrade() -> None:
    op.drop_index("ix_settlements_relay_nonce", table_name="settlements")
    op.drop_index("uq_settlements_open_relay_nonce", table_name="settlements")
