"""wallets.verified_at: when the payout wallet proved, by signing the service's message, that it is the merchant's
(backend.merchants.proofs); NULL for a pasted address. Existing wallets are unverified.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 12:35:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('wallets', sa.Column('verified_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.execute('ALTER TABLE wallets DROP COLUMN verified_at')  # SQLite 3.35+ and PostgreSQL, no rebuild
