"""settlements record the nonce of the relay account's transaction (relay_nonce, EVM; NULL on Solana rows and on
rows written before): with relay_address, the (account, nonce) a settlement's transaction holds, written before
it is broadcast, so the relay's nonce manager can start after every nonce a settlement took and a settlement's
replacement goes at the same (account, nonce) (docs/architecture.md, "Nonces"). Downgrade drops it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 06:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.add_column(sa.Column('relay_nonce', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.drop_column('relay_nonce')
