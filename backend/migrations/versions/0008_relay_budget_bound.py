"""relay_spending index (network, created_at): the largest recent gas charge of a network, the EVM estimate of
what one settlement may cost (the relay budget reserves it for every open settlement)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 12:00:00
"""
from alembic import op


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('relay_spending', schema=None) as batch_op:
        batch_op.create_index('ix_relay_spending_network_created', ['network', 'created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('relay_spending', schema=None) as batch_op:
        batch_op.drop_index('ix_relay_spending_network_created')
