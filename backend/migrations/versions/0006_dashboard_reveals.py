"""dashboard_reveals: a new API key or webhook secret waits here (encrypted) for the one page that shows it

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 09:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('dashboard_reveals',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('merchant_id', sa.String(length=40), nullable=False),
    sa.Column('session_hash', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('subject', sa.Text(), nullable=False),
    sa.Column('ciphertext', sa.LargeBinary(), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['merchant_id'], ['merchants.id'], name=op.f('fk_dashboard_reveals_merchant_id_merchants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dashboard_reveals'))
    )
    with op.batch_alter_table('dashboard_reveals', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_dashboard_reveals_expires_at'), ['expires_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_dashboard_reveals_merchant_id'), ['merchant_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_dashboard_reveals_session_hash'), ['session_hash'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('dashboard_reveals', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_dashboard_reveals_session_hash'))
        batch_op.drop_index(batch_op.f('ix_dashboard_reveals_merchant_id'))
        batch_op.drop_index(batch_op.f('ix_dashboard_reveals_expires_at'))

    op.drop_table('dashboard_reveals')
