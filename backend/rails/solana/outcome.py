"""The Solana rail's finish-from-chain: what the chain says about a co-signed transaction.

The relay's signature (the transaction id) is recorded before sending, so a crash after the send still
leaves the signature to look up. Executed (confirmed) → paid; failed (at confirmed or finalized commitment)
→ failed. The intent is released unexecuted only when the finalized height is past ``last_valid_block_height``
and the node no longer accepts the blockhash: then the transaction can never land. The height is read before the
status, so a transaction landing in between is seen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from backend.chains.solana import SolanaChain, SolanaRpcError
from backend.rails.base import ChainOutcome, Claim, Outcome, PayeeLedger, Terms
from backend.rails.solana.poller import LANDED
from backend.rails.solana.relay import fee
from backend.rails.solana.terms import SolanaTerms
from payintent import solana_tx as stx

log = logging.getLogger(__name__)

EXPIRED_DETAIL = "the transaction's blockhash expired before it executed"


def read_outcome(chain: SolanaChain, claim: Claim, may_still_execute: Callable[[Terms, int], bool]) -> ChainOutcome:
    """USED or FAILED (landed, with the fee it cost the relay), PENDING (seen, not confirmed), UNUSED (it may still
    land) or EXPIRED. ``may_still_execute``: the rail's comparison of ``last_valid_block_height`` with the
    finalized height."""
    height = chain.block_height("finalized")
    if claim.tx_id:
        status = chain.signature_status(claim.tx_id)
        if status is not None and status.get("confirmationStatus") in LANDED:
            if status.get("err") is not None:
                return ChainOutcome(Outcome.FAILED, claim.tx_id, f"transaction failed: {status['err']}", fee(claim))
            return ChainOutcome(Outcome.USED, claim.tx_id, "", fee(claim))
        if status is not None:
            return ChainOutcome(Outcome.PENDING, claim.tx_id)  # seen but not yet confirmed
    terms = claim.terms
    assert isinstance(terms, SolanaTerms)
    if may_still_execute(terms, height):
        return ChainOutcome(Outcome.UNUSED)
    blockhash = str(stx.decode(terms.transaction).message.recent_blockhash)
    if chain.is_blockhash_valid(blockhash):
        return ChainOutcome(Outcome.UNUSED)
    return ChainOutcome(Outcome.EXPIRED, None, EXPIRED_DETAIL)


def before_paid(chain: SolanaChain, network_id: str, claim: Claim, ledger: PayeeLedger) -> bool:
    """A payment that landed is recorded in its account (``PayeeLedger.record_landed``) before it is marked paid,
    with the chain's genesis hash read first: if that cannot be read, False (the settlement is left open and the
    reconciler finishes it later)."""
    try:
        genesis = chain.genesis_hash()
    except SolanaRpcError as exc:
        log.warning("settlement %s landed; genesis hash unreadable, left open (%s)", claim.settlement_id, exc)
        return False
    ledger.record_landed(network_id, claim.terms.pay_to, claim.asset, genesis)
    return True
