"""refunds: a paid intent's refunds (backend.intents.refunds), paid from the merchant's wallet to the buyer through a
settlement of their own (settlements.refund_id); intents.refunded_atomic sums those that succeeded. Downgrade drops
all three.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 12:30:00
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('refunds',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('intent_id', sa.String(length=36), nullable=False),
    sa.Column('merchant_id', sa.String(length=40), nullable=False),
    sa.Column('network', sa.String(length=64), nullable=False),
    sa.Column('amount_atomic', sa.BigInteger(), nullable=False),
    sa.Column('pay_from', sa.String(length=64), nullable=False),
    sa.Column('pay_to', sa.String(length=64), nullable=False),
    sa.Column('requirement', sa.JSON().with_variant(postgresql.JSONB(), 'postgresql'), nullable=False),
    sa.Column('reason', sa.String(length=500), nullable=True),
    sa.Column('status', sa.String(length=24), nullable=False),
    sa.Column('settlement_id', sa.String(length=40), nullable=True),
    sa.Column('tx_hash', sa.String(length=128), nullable=True),
    sa.Column('failure_code', sa.String(length=64), nullable=True),
    sa.Column('failure_reason', sa.String(length=500), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('succeeded_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['intent_id'], ['intents.id'], name=op.f('fk_refunds_intent_id_intents'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['merchant_id'], ['merchants.id'], name=op.f('fk_refunds_merchant_id_merchants'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_refunds'))
    )
    with op.batch_alter_table('refunds', schema=None) as batch_op:
        batch_op.create_index('ix_refunds_intent', ['intent_id'], unique=False)
        batch_op.create_index('ix_refunds_merchant_created', ['merchant_id', 'created_at'], unique=False)
    # Plain ALTER TABLE on both engines (see 0013): no rebuild of intents or settlements on SQLite.
    op.add_column('intents', sa.Column('refunded_atomic', sa.BigInteger(), server_default=sa.text('0'), nullable=False))
    op.add_column('settlements', sa.Column('refund_id', sa.String(length=40), nullable=True))
    op.create_index('ix_settlements_refund', 'settlements', ['refund_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_settlements_refund', table_name='settlements')
    op.execute('ALTER TABLE settlements DROP COLUMN refund_id')  # SQLite 3.35+ and PostgreSQL, no rebuild
    op.execute('ALTER TABLE intents DROP COLUMN refunded_atomic')
    with op.batch_alter_table('refunds', schema=None) as batch_op:
        batch_op.drop_index('ix_refunds_merchant_created')
        batch_op.drop_index('ix_refunds_intent')
    op.drop_table('refunds')
