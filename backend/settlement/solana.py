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
marked paid (``finish_from_chain``), so a finished payment is never without it.
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
from backend.rails.solana.rail import SOLANA_RAIL, SolanaTerms, account_closed, payee_account_ready, relay
from backend.rails.solana.rail import unavailable as _unavailable
from backend.relaybudget import services as relaybudget
from backend.relaybudget.models import FEE
from backend.settlement import services
from backend.settlement.models import PayeeAccount, settlement_terms
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
    try:
        payer = normalize_solana_address(payer)
    except AddressError as exc:
        raise DomainError("VALIDATION_ERROR", f"payer: {exc}", fields={"payer": [str(exc)]}) from None
    fee_payer = relay(network)
    if payer == requirement["payTo"]:
        raise DomainError("PAYER_IS_RECIPIENT", "The payer is the merchant's own wallet")
    if payer == fee_payer:
        raise DomainError("VALIDATION_ERROR", "payer: the relay cannot pay", fields={"payer": ["is the relay"]})
    # Before any RPC (a refused merchant costs nothing), and with the least this transaction costs the relay:
    # advisory (no lock; /pay decides), it never refuses what /pay would admit.
    least = 2 * stx.LAMPORTS_PER_SIGNATURE + stx.priority_fee(stx.COMPUTE_UNIT_LIMIT, stx.COMPUTE_UNIT_PRICE)
    relaybudget.admit(
        intent.merchant_id,
        network,
        settings,
        cost=least,
        open_settlements=services.count_open(intent.merchant_id, network.network),
        open_cost=relaybudget.max_settlement_cost(network, settings, intent.merchant_id),
        endpoint=relaybudget.PREPARE,
    )
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
            "The buyer's USDC balance is too low for this payment",
            reason=f"insufficient balance: {from_atomic(balance or 0)} USDC available, {from_atomic(amount)} required",
        )
    try:
        ready = payee_account_ready(chain, requirement)
        if not ready and payee_account_closed(chain, network.network, requirement["payTo"], requirement["asset"]):
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
        intent_id=intent.id,
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


def record_payee_account(settlement: Any, genesis: str) -> None:
    """Remember that the settlement's payment landed in the merchant's account of its mint on the chain whose
    genesis hash is ``genesis`` (idempotent). Commits. Called before the settlement is marked paid: once it is,
    nothing looks at it again, and a record lost then would let the next buyer pay the rent again."""
    dialect = postgresql if db.engine.dialect.name == "postgresql" else sqlite
    values = {"network": settlement.network, "owner": settlement.pay_to, "mint": settlement.asset,
              "genesis_hash": genesis, "created_at": clock.now()}  # fmt: skip
    db.session.execute(
        dialect.insert(PayeeAccount)
        .values(**values)
        .on_conflict_do_nothing(index_elements=["network", "owner", "mint", "genesis_hash"])
    )
    db.session.commit()


SolanaAuthorization = SolanaTerms  # the name tests know
_RAIL = SOLANA_RAIL  # finish_from_chain moves into the rail in stage 2 (docs/architecture.md, "Rails")


class PayeeLedger:
    """The settlement store's answer to the Solana rail (``rails.base.PayeeLedger``): ``PayeeAccount`` rows."""

    def landed_before(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> bool:
        return _landed(network_id, owner, mint, genesis_hash)


def finish_from_chain(chain: SolanaChain, settlement: Any) -> bool:
    """Finish a Solana settlement if the chain has decided it; returns whether it is finished.

    The relay's signature (the transaction id) is recorded before sending, so a crash after the
    send still leaves the signature to look up. Executed (confirmed) → paid; failed (at confirmed
    or finalized commitment) → failed. The intent is released unexecuted only when the finalized
    height is past ``last_valid_block_height`` and the node no longer accepts the blockhash: then the
    transaction can never land. The height is read before the status, so a transaction landing
    in between is seen.

    A payment that landed is recorded in its account (``record_payee_account``) before it is marked
    paid, with the chain's genesis hash read first: if that cannot be read, the settlement is left
    open (False) and the reconciler finishes it later.
    """
    height = chain.block_height("finalized")
    if settlement.tx_hash:
        status = chain.signature_status(settlement.tx_hash)
        if status is not None and status.get("confirmationStatus") in ("confirmed", "finalized"):
            if status.get("err") is not None:
                charge_fee(settlement)  # first: the settlement is not looked at again once finished
                services.fail_settlement(settlement.id, "SETTLEMENT_FAILED", f"transaction failed: {status['err']}")
                return True
            try:
                genesis = chain.genesis_hash()
            except SolanaRpcError as exc:
                log.warning("settlement %s landed; genesis hash unreadable, left open (%s)", settlement.id, exc)
                return False
            charge_fee(settlement)
            record_payee_account(settlement, genesis)  # both first, for the same reason
            services.complete_settlement(settlement.id, settlement.tx_hash)
            return True
        if status is not None:
            return False  # seen but not yet confirmed
    terms = settlement_terms(settlement)
    assert isinstance(terms, SolanaTerms)
    if _RAIL.may_still_execute(terms, height):
        return False
    blockhash = str(stx.decode(terms.transaction).message.recent_blockhash)
    if chain.is_blockhash_valid(blockhash):
        return False
    services.fail_settlement(
        settlement.id, "AUTHORIZATION_EXPIRED", "the transaction's blockhash expired before it executed"
    )
    return True


def charge_fee(settlement: Any) -> None:
    """Record the fee the relay paid for the settlement's landed transaction (successful or not) to the
    merchant's relay budget, once."""
    terms = settlement_terms(settlement)
    assert isinstance(terms, SolanaTerms)
    fee = stx.transaction_fee(stx.decode(terms.transaction).message)
    relaybudget.charge(settlement.merchant_id, settlement.network, FEE, fee, settlement.tx_hash, settlement.id)
