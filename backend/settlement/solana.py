"""Solana payments on the API side: the unsigned transaction, and the checks before the relay co-signs.

The API holds no key. It builds the transaction the buyer signs (``prepare_transaction``); at
``/pay`` the Solana rail (``backend.rails.solana``) checks the buyer-signed one instruction by
instruction (``payintent.solana_tx``) and simulates it without signature verification (the relay
has not signed yet), asking ``PayeeLedger`` here about accounts closed after payments landed.

The relay pays transaction fees only, never an account's rent: when the merchant's USDC account
does not exist (a new wallet, a devnet restarted under a kept ``var/``), the prepared transaction
opens it itself (``CreateIdempotent``) with the **buyer** funding the rent. Nothing the service
does on an unsigned request spends the relay's SOL.

A buyer pays that rent at most once per account and chain: once a payment of ours has landed in
the account (``PayeeAccount``, keyed by owner, mint and the chain's genesis hash), an account found
missing again on the same chain was closed by its owner, who took the rent back; the next buyer is
not asked to pay it again (``409 PAYEE_ACCOUNT_CLOSED``) until the merchant opens the account
itself. A chain with another genesis hash is a new chain, and another mint another account, where
the first payment opens it as at first. The record is written before the landed settlement is
marked paid (the rail's ``before_paid`` through ``PayeeLedger.record_landed``, called by
``reconcile.paid``), so a finished payment is never without it.
"""

from __future__ import annotations

import logging
from decimal import Decimal
from typing import Any

from solders.pubkey import Pubkey
from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite

from backend import clock
from backend.chains.addresses import AddressError, normalize_solana_address
from backend.chains.registry import ChainRegistry, Network
from backend.chains.solana import SolanaChain, SolanaRpcError, solana_chain
from backend.chains.solana import _chains as _chains  # the API's clients (tests put stand-ins here)
from backend.config import Settings
from backend.errors import DomainError
from backend.extensions import db
from backend.intents.models import Intent
from backend.money import from_atomic
from backend.rails.registry import rail_for
from backend.rails.solana.rail import SolanaTerms, account_closed, payee_account_ready, relay
from backend.rails.solana.rail import unavailable as _unavailable
from backend.relaybudget import services as relaybudget
from backend.settlement import services
from backend.settlement.models import PayeeAccount
from payintent import solana_tx as stx

log = logging.getLogger(__name__)


def solana_requirement(
    intent: Intent, registry: ChainRegistry, network_id: str | None
) -> tuple[dict[str, Any], Network]:
    """The intent's Solana requirement (the named one, or its only Solana one) and its network: one whose rail
    prepares the transaction the buyer signs."""
    for requirement in intent.payment_requirements or []:
        network = registry.get(requirement["network"])
        if network is None or not rail_for(network).prepares_transaction:
            continue
        if network_id is None or network_id == network.network:
            return requirement, network
    raise DomainError("UNSUPPORTED_NETWORK", "This intent has no Solana payment requirement for that network")


def prepare_transaction(
    intent: Intent,
    registry: ChainRegistry,
    payer: str,
    network_id: str | None,
    settings: Settings,
) -> dict[str, Any]:
    """The base64 transaction the buyer signs: fresh blockhash, relay as fee payer, exact amount, memo.

    When the merchant's USDC account is missing, the transaction also opens it, funded by the buyer
    (``payer_pays_lamports`` says how much): a payer with too little SOL for that is refused here,
    before signing (402 PAYER_NEEDS_SOL); so is every payer while the account is closed after payments
    landed in it on this chain (409 PAYEE_ACCOUNT_CLOSED). Spends nothing of the relay's.
    """
    services.check_payable(intent, clock.now())
    requirement, network = solana_requirement(intent, registry, network_id)
    return prepare_for(network, requirement, payer, intent.id, intent.merchant_id, settings)


def prepare_for(
    network: Network,
    requirement: dict[str, Any],
    payer: str,
    memo: str,
    merchant_id: str,
    settings: Settings,
    *,
    payee_rule: bool = True,
) -> dict[str, Any]:
    """The base64 transaction ``payer`` signs to pay ``requirement`` (an intent's, or a refund's: the merchant's
    wallet pays the buyer back), with ``memo`` (the intent's or the refund's id); see ``prepare_transaction``.
    ``payee_rule`` False (a refund): a missing recipient account is opened at the payer's cost, whatever landed
    there before. Commits nothing, and ends the session's transaction before the chain's reads."""
    try:
        payer = normalize_solana_address(payer)
    except AddressError as exc:
        raise DomainError("VALIDATION_ERROR", f"payer: {exc}", fields={"payer": [str(exc)]}) from None
    fee_payer = relay(network)
    if payer == requirement["payTo"]:
        raise DomainError("PAYER_IS_RECIPIENT", "The payer is the recipient's own wallet")
    if payer == fee_payer:
        raise DomainError("VALIDATION_ERROR", "payer: the relay cannot pay", fields={"payer": ["is the relay"]})
    # Before any RPC (a refused merchant costs nothing), and with the least this transaction costs the relay:
    # advisory (no lock; /pay decides), it never refuses what /pay would admit.
    least = 2 * stx.LAMPORTS_PER_SIGNATURE + stx.priority_fee(stx.COMPUTE_UNIT_LIMIT, stx.COMPUTE_UNIT_PRICE)
    relaybudget.admit(
        merchant_id,
        network,
        settings,
        cost=least,
        open_settlements=services.count_open(merchant_id, network.network),
        open_cost=relaybudget.max_settlement_cost(network, settings, merchant_id),
        endpoint=relaybudget.PREPARE,
    )
    # Read-only so far: the transaction ends before the RPC calls, which hold no database connection.
    db.session.rollback()
    chain = solana_chain(network)
    amount = int(requirement["maxAmountRequired"])
    try:
        blockhash = chain.latest_blockhash()
        balance = chain.token_balance(
            str(stx.associated_token_address(Pubkey.from_string(payer), Pubkey.from_string(requirement["asset"])))
        )
    except SolanaRpcError as exc:
        raise _unavailable(network, exc) from None  # fmt: skip
    if (balance or 0) < amount:
        raise DomainError(
            "SETTLEMENT_FAILED",
            "The payer's USDC balance is too low for this payment",
            reason=f"insufficient balance: {from_atomic(balance or 0)} USDC available, {from_atomic(amount)} required",
        )
    try:
        ready = payee_account_ready(chain, requirement)
        if not ready and payee_rule:
            closed = payee_account_closed(chain, network.network, requirement["payTo"], requirement["asset"])
            db.session.rollback()  # its one read done: nothing held across the RPC calls below
            if closed:
                raise account_closed(network)
        rent = 0 if ready else chain.rent_exempt_minimum(stx.TOKEN_ACCOUNT_SIZE)
        # What is left must be nothing, or enough for the payer's own account to stay rent-exempt.
        left = chain.lamports(payer) - rent if rent else 0
        if left < 0 or 0 < left < (chain.rent_exempt_minimum(0) if rent else 0):
            raise DomainError(
                "PAYER_NEEDS_SOL",
                f"This is the first payment to the merchant's USDC account on {network.name}: it opens the account, "
                f"and the payer pays its rent of {_sol(rent)} SOL, which the payer cannot spare; add SOL to the payer "
                f"or pay on another network",
                rent_lamports=rent,
            )
    except SolanaRpcError as exc:
        raise _unavailable(network, exc) from None
    tx = stx.build_payment(
        fee_payer=fee_payer,
        payer=payer,
        mint=requirement["asset"],
        pay_to=requirement["payTo"],
        amount_atomic=amount,
        intent_id=memo,
        recent_blockhash=blockhash.blockhash,
        create_payee_account=rent > 0,
    )
    return {
        "transaction": stx.encode(tx),
        "network": network.network,
        "payer": payer,
        "fee_payer": fee_payer,
        "recent_blockhash": blockhash.blockhash,
        "last_valid_block_height": blockhash.last_valid_block_height,
        "creates_payee_account": rent > 0,
        "payer_pays_lamports": rent,
    }


def _sol(lamports: int) -> str:
    return format(Decimal(lamports).scaleb(-9).normalize(), "f")


def payee_account_closed(chain: SolanaChain, network_id: str, owner: str, mint: str) -> bool:
    """Whether a payment of ours landed in ``owner``'s account of ``mint`` on this chain (same genesis hash): if
    the account is missing now, its owner closed it. Raises SolanaRpcError if the genesis hash cannot be read."""
    return _landed(network_id, owner, mint, chain.genesis_hash())


def _landed(network_id: str, owner: str, mint: str, genesis: str) -> bool:
    found = db.session.scalar(
        select(PayeeAccount.id)
        .where(
            PayeeAccount.network == network_id,
            PayeeAccount.owner == owner,
            PayeeAccount.mint == mint,
            PayeeAccount.genesis_hash == genesis,
        )
        .limit(1)
    )
    return found is not None


def record_payee_account(network_id: str, owner: str, mint: str, genesis: str) -> None:
    """Remember that a settlement's payment landed in ``owner``'s account of ``mint`` on the chain whose genesis
    hash is ``genesis`` (idempotent). Commits. Called before the settlement is marked paid: once it is, nothing
    looks at it again, and a record lost then would let the next buyer pay the rent again."""
    dialect = postgresql if db.engine.dialect.name == "postgresql" else sqlite
    values = {"network": network_id, "owner": owner, "mint": mint, "genesis_hash": genesis, "created_at": clock.now()}
    db.session.execute(
        dialect.insert(PayeeAccount)
        .values(**values)
        .on_conflict_do_nothing(index_elements=["network", "owner", "mint", "genesis_hash"])
    )
    db.session.commit()


SolanaAuthorization = SolanaTerms  # the name tests know


class PayeeLedger:
    """The settlement store's answer to the rails (``rails.base.PayeeLedger``): ``PayeeAccount`` rows."""

    def landed_before(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> bool:
        return _landed(network_id, owner, mint, genesis_hash)

    def record_landed(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> None:
        record_payee_account(network_id, owner, mint, genesis_hash)
