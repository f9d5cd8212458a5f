"""wallets.token_account_created_at: the relay creates a merchant's Solana USDC account once

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 08:40:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('wallets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('token_account_created_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('wallets', schema=None) as batch_op:
        batch_op.drop_column('token_account_created_at')
