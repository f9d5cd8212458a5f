"""settlements.watched_at / watch_done_at: released settlements are watched until the chain decides, round-robin

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 09:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.add_column(sa.Column('watched_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('watch_done_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index('ix_settlements_watched_at', ['watched_at'], unique=False)
    # Every settlement released while its authorization may still execute enters the watch, however old:
    # one look decides the ones long past their validBefore, and records any that executed unseen.
    op.execute(
        "UPDATE settlements SET watched_at = COALESCE(finished_at, updated_at) "
        "WHERE status = 'failed' AND failure_code IN ('SETTLEMENT_FAILED', 'ALREADY_PAID')"
    )


def downgrade() -> None:
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.drop_index('ix_settlements_watched_at')
        batch_op.drop_column('watch_done_at')
        batch_op.drop_column('watched_at')
