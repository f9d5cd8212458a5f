"""solana_payee_accounts per mint: a record is (network, owner, mint, genesis hash), so a network moved to another
USDC mint does not take every merchant paid before for one that closed its account. Existing records get the mints
of the confirmed settlements paid to that owner on that network (what actually landed); a record no settlement
explains is dropped (its account, if closed, is opened once more at a buyer's cost: the behaviour before 0008).
relay_spending loses its (network, created_at) index: the EVM estimate reads a merchant's own charges only (the
(merchant_id, network, created_at) index), never the network's largest.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 12:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('relay_spending', schema=None) as batch_op:
        batch_op.drop_index('ix_relay_spending_network_created')
    with op.batch_alter_table('solana_payee_accounts', schema=None) as batch_op:
        batch_op.drop_constraint('uq_solana_payee_accounts_network_owner_genesis_hash', type_='unique')
        batch_op.add_column(sa.Column('mint', sa.String(length=64), nullable=True))
    op.execute(
        "INSERT INTO solana_payee_accounts (network, owner, mint, genesis_hash, created_at) "
        "SELECT DISTINCT p.network, p.owner, s.asset, p.genesis_hash, p.created_at "
        "FROM solana_payee_accounts p JOIN settlements s "
        "ON s.network = p.network AND s.pay_to = p.owner AND s.status = 'confirmed' "
        "WHERE p.mint IS NULL"
    )
    op.execute("DELETE FROM solana_payee_accounts WHERE mint IS NULL")
    with op.batch_alter_table('solana_payee_accounts', schema=None) as batch_op:
        batch_op.alter_column('mint', existing_type=sa.String(length=64), nullable=False)
        batch_op.create_unique_constraint(
            batch_op.f('uq_solana_payee_accounts_network_owner_mint_genesis_hash'),
            ['network', 'owner', 'mint', 'genesis_hash'],
        )


def downgrade() -> None:
    op.execute(
        "DELETE FROM solana_payee_accounts WHERE id NOT IN "
        "(SELECT MIN(id) FROM solana_payee_accounts GROUP BY network, owner, genesis_hash)"
    )
    with op.batch_alter_table('solana_payee_accounts', schema=None) as batch_op:
        batch_op.drop_constraint('uq_solana_payee_accounts_network_owner_mint_genesis_hash', type_='unique')
        batch_op.drop_column('mint')
        batch_op.create_unique_constraint(
            batch_op.f('uq_solana_payee_accounts_network_owner_genesis_hash'), ['network', 'owner', 'genesis_hash']
        )
    with op.batch_alter_table('relay_spending', schema=None) as batch_op:
        batch_op.create_index('ix_relay_spending_network_created', ['network', 'created_at'], unique=False)
