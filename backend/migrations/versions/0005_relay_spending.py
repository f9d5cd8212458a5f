"""relay_spending: what the relay paid on each merchant's behalf (the relay budget's ledger);
wallets.token_account_created_at goes (the relay no longer opens merchants' Solana accounts)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 09:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('relay_spending',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('merchant_id', sa.String(length=40), nullable=False),
    sa.Column('network', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('amount_atomic', sa.BigInteger(), nullable=False),
    sa.Column('reference', sa.String(length=128), nullable=False),
    sa.Column('settlement_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['merchant_id'], ['merchants.id'], name=op.f('fk_relay_spending_merchant_id_merchants'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['settlement_id'], ['settlements.id'], name=op.f('fk_relay_spending_settlement_id_settlements'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_relay_spending')),
    sa.UniqueConstraint('network', 'reference', 'kind', name=op.f('uq_relay_spending_network_reference_kind'))
    )
    with op.batch_alter_table('relay_spending', schema=None) as batch_op:
        batch_op.create_index('ix_relay_spending_merchant_window', ['merchant_id', 'network', 'created_at'], unique=False)

    with op.batch_alter_table('wallets', schema=None) as batch_op:
        batch_op.drop_column('token_account_created_at')


def downgrade() -> None:
    with op.batch_alter_table('wallets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('token_account_created_at', sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table('relay_spending', schema=None) as batch_op:
        batch_op.drop_index('ix_relay_spending_merchant_window')

    op.drop_table('relay_spending')
