"""settlements store rail-typed terms: Solana rows get their own columns (last_valid_block_height, the block height
their blockhash surely expired by; signed_transaction, the buyer-signed transaction in base64), and the EVM columns
(valid_after, valid_before: unix times; signature: 0x-hex) become NULL on them. Before, a Solana row kept its height
in valid_before, its transaction in signature and 0 in valid_after. A CHECK says each row has exactly its rail's
columns (its rail: its network's CAIP-2 namespace, eip155 or solana). The common columns (payer, pay_to,
amount_atomic, nonce) are unchanged. Downgrade puts the Solana values back where they were.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 04:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

# What backend.settlement.models builds from the rails (Settlement's CHECK ``terms_of_rail``), as of this revision.
TERMS_OF_RAIL = (
    "(network LIKE 'eip155:%' AND valid_after IS NOT NULL AND valid_before IS NOT NULL AND signature IS NOT NULL "
    "AND last_valid_block_height IS NULL AND signed_transaction IS NULL) OR "
    "(network LIKE 'solana:%' AND last_valid_block_height IS NOT NULL AND signed_transaction IS NOT NULL "
    "AND valid_after IS NULL AND valid_before IS NULL AND signature IS NULL)"
)


def upgrade() -> None:
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.add_column(sa.Column('last_valid_block_height', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('signed_transaction', sa.Text(), nullable=True))
        batch_op.alter_column('valid_after', existing_type=sa.BigInteger(), nullable=True)
        batch_op.alter_column('valid_before', existing_type=sa.BigInteger(), nullable=True)
        batch_op.alter_column('signature', existing_type=sa.Text(), nullable=True)
    # Every assignment reads the row's values from before the UPDATE (SQLite and PostgreSQL alike).
    op.execute(
        "UPDATE settlements SET last_valid_block_height = valid_before, signed_transaction = signature, "
        "valid_after = NULL, valid_before = NULL, signature = NULL WHERE network LIKE 'solana:%'"
    )
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.create_check_constraint(batch_op.f('ck_settlements_terms_of_rail'), sa.text(TERMS_OF_RAIL))


def downgrade() -> None:
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('ck_settlements_terms_of_rail'), type_='check')
    op.execute(
        "UPDATE settlements SET valid_after = 0, valid_before = last_valid_block_height, "
        "signature = signed_transaction WHERE network LIKE 'solana:%'"
    )
    with op.batch_alter_table('settlements', schema=None) as batch_op:
        batch_op.alter_column('signature', existing_type=sa.Text(), nullable=False)
        batch_op.alter_column('valid_before', existing_type=sa.BigInteger(), nullable=False)
        batch_op.alter_column('valid_after', existing_type=sa.BigInteger(), nullable=False)
        batch_op.drop_column('signed_transaction')
        batch_op.drop_column('last_valid_block_height')
