"""relay_spending index (network, created_at): the largest recent gas charge of a network, the EVM estimate of
what one settlement may cost (the relay budget reserves it for every open settlement); solana_payee_accounts:
merchants' Solana USDC accounts payments landed in, per chain (genesis hash), so a closed one is not opened
again at the next buyer's cost

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 12:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('relay_spending', schema=None) as batch_op:
        batch_op.create_index('ix_relay_spending_network_created', ['network', 'created_at'], unique=False)
    op.create_table('solana_payee_accounts',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('network', sa.String(length=64), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=False),
    sa.Column('genesis_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_solana_payee_accounts')),
    sa.UniqueConstraint('network', 'owner', 'genesis_hash', name=op.f('uq_solana_payee_accounts_network_owner_genesis_hash'))
    )


def downgrade() -> None:
    op.drop_table('solana_payee_accounts')
    with op.batch_alter_table('relay_spending', schema=None) as batch_op:
        batch_op.drop_index('ix_relay_spending_network_created')
