"""payment_links: a fixed price at a shareable URL (backend.paymentlinks); intents.payment_link_id names the link
whose visit made the intent. Downgrade drops both (the intents stay, without their link).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 09:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('payment_links',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('merchant_id', sa.String(length=40), nullable=False),
    sa.Column('amount_atomic', sa.BigInteger(), nullable=False),
    sa.Column('description', sa.String(length=500), nullable=False),
    sa.Column('redirect_url', sa.String(length=2048), nullable=True),
    sa.Column('active', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deactivated_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['merchant_id'], ['merchants.id'], name=op.f('fk_payment_links_merchant_id_merchants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_payment_links'))
    )
    with op.batch_alter_table('payment_links', schema=None) as batch_op:
        batch_op.create_index('ix_payment_links_merchant_created', ['merchant_id', 'created_at'], unique=False)
    # Plain ALTER TABLE on both engines: a batch operation would rebuild intents on SQLite, which the settlements'
    # foreign keys to it forbid.
    op.add_column('intents', sa.Column('payment_link_id', sa.String(length=40), nullable=True))
    op.create_index('ix_intents_payment_link', 'intents', ['payment_link_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_intents_payment_link', table_name='intents')
    op.execute('ALTER TABLE intents DROP COLUMN payment_link_id')  # SQLite 3.35+ and PostgreSQL, no rebuild
    with op.batch_alter_table('payment_links', schema=None) as batch_op:
        batch_op.drop_index('ix_payment_links_merchant_created')
    op.drop_table('payment_links')
