"""settlements

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 05:19:50.061637
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('settlements',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('intent_id', sa.String(length=36), nullable=False),
    sa.Column('merchant_id', sa.String(length=40), nullable=False),
    sa.Column('network', sa.String(length=64), nullable=False),
    sa.Column('asset', sa.String(length=64), nullable=False),
    sa.Column('payer', sa.String(length=64), nullable=False),
    sa.Column('pay_to', sa.String(length=64), nullable=False),
    sa.Column('amount_atomic', sa.BigInteger(), nullable=False),
    sa.Column('valid_after', sa.BigInteger(), nullable=False),
    sa.Column('valid_before', sa.BigInteger(), nullable=False),
    sa.Column('nonce', sa.String(length=66), nullable=False),
    sa.Column('signature', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('tx_hash', sa.String(length=128), nullable=True),
    sa.Column('start_block', sa.BigInteger(), nullable=True),
    sa.Column('relay_address', sa.String(length=64), nullable=True),
    sa.Column('failure_code', sa.String(length=64), nullable=True),
    sa.Column('failure_reason', sa.String(length=500), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('submitted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['intent_id'], ['intents.id'], name=op.f('fk_settlements_intent_id_intents'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['merchant_id'], ['merchants.id'], name=op.f('fk_settlements_merchant_id_merchants'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_settlements')),
    sa.UniqueConstraint('network', 'payer', 'nonce', name=op.f('uq_settlements_network_payer_nonce'))
    )
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_settlements_intent_id'), ['intent_id'], unique=False)
        batch_op.create_index('ix_settlements_status_updated', ['status', 'updated_at'], unique=False)

    with op.batch_alter_table('intents', schema=None) as batch_op:
        batch_op.add_column(sa.Column('settlement_id', sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('intents', schema=None) as batch_op:
        batch_op.drop_column('settlement_id')

    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.drop_index('ix_settlements_status_updated')
        batch_op.drop_index(batch_op.f('ix_settlements_intent_id'))

    op.drop_table('settlements')
