"""The EVM rail's finish-from-chain: what the token's state and logs say about an authorization.

The token's ``authorizationState(from, nonce)`` and its AuthorizationUsed/Canceled events are
the truth: an authorization that executed means the intent is paid, whatever our processes
managed to record before dying.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import Any

from flask import current_app, has_app_context

from backend import appstate
from backend.chains.evm import (
    AUTHORIZATION_USED_TOPIC,
    DEFAULT_LOG_BLOCK_RANGE,
    EvmChain,
    LogSearchIncomplete,
    authorization_transfer,
)
from backend.rails.base import ChainOutcome, Claim, Outcome
from backend.rails.evm.terms import EvmTerms
from backend.rails.evm.watch import relay_cost

log = logging.getLogger(__name__)

# One log search (``onchain_outcome``) runs at most this long unless its caller gives a deadline (the relayer's).
LOG_SEARCH_SECONDS = 20.0
# Chain clocks and ours may differ: give up on an unexecuted authorization only this long after validBefore
# (the newest final block's timestamp past it by this much: no block that can still join the chain executes it).
EXPIRY_GRACE_SECONDS = 60
CANCELED_DETAIL = "the buyer cancelled the authorization"
EXPIRED_DETAIL = "the authorization expired before it could be executed"


def may_still_execute(valid_before: int, chain_now: int) -> bool:
    # The token executes it only in a block with timestamp < validBefore; the grace covers final blocks
    # whose timestamps lag (``chain_now`` is the newest final block's timestamp).
    return chain_now <= valid_before + EXPIRY_GRACE_SECONDS


def _paid_this(chain: EvmChain, claim: Claim, receipt: dict[str, Any], nonce: bytes) -> bool | None:
    """Whether the authorization that used the nonce in ``receipt`` moved exactly the claim's terms
    (payer -> pay_to, amount); None if the receipt does not show what it moved."""
    moved = authorization_transfer(receipt, chain.token.address, claim.terms.payer, nonce)
    if moved is None:
        return None
    to, value = moved
    return to.lower() == claim.terms.pay_to.lower() and value == claim.terms.value


def log_block_range() -> int:
    """RECONCILE_LOG_BLOCK_RANGE of the app in context (the worker's, the relayer's), else the default."""
    if has_app_context() and appstate.SETTINGS_KEY in current_app.config:
        return int(appstate.settings().reconcile_log_block_range)
    return DEFAULT_LOG_BLOCK_RANGE


def onchain_outcome(
    chain: EvmChain,
    claim: Claim,
    head: int | None = None,
    log_range: int | None = None,
    deadline: float | None = None,
) -> tuple[Outcome, str | None]:
    """What the chain says about the claim's authorization: USED, USED_ELSEWHERE, CANCELED, NOT_FINAL
    or UNUSED.

    The height (``head``, unless given) is read first, and the state, the receipt and the log search are
    pinned to it: a log or receipt found is final only if it is buried under the confirmations at that
    height, so a reorg between the reads cannot pass for final, and a lagging RPC node cannot answer "unused"
    from an older state. A used nonce counts as this payment only if the same transaction moved this
    settlement's terms: the buyer may have signed the nonce again for something else.

    Our own transaction (``tx_id``) is looked up first, by its receipt: no log search, which RPC providers
    limit. Only when it did not execute the authorization (none sent, reverted, not mined) are the token's
    logs searched, from the claim's height, in windows of ``log_range`` blocks (RECONCILE_LOG_BLOCK_RANGE;
    ``EvmChain.authorization_log``). An RPC error raises: it is never taken for "not found". A search still
    unfinished at ``deadline`` (``time.monotonic()``; by default LOG_SEARCH_SECONDS from now) is NOT_FINAL: the
    next look goes on from where it stopped (short of the newest blocks). A search that finished with no match
    is NOT_FINAL too, and the next look searches again from the claim's block (an RPC answered incompletely).
    """
    terms, settlement_id = claim.terms, claim.settlement_id
    nonce = bytes.fromhex(terms.nonce_hex[2:])
    head = chain.block_number() if head is None else head
    if not chain.authorization_state(terms.payer, nonce, head):
        return Outcome.UNUSED, None
    if claim.tx_id:
        receipt = chain.receipt(claim.tx_id)
        if receipt is not None and receipt.get("status") == 1 and _paid_this(chain, claim, receipt, nonce):
            # Our transaction executed it with this settlement's terms: paid once its block is final at ``head``.
            final = chain.is_final(int(receipt["blockNumber"]), head)
            return (Outcome.USED if final else Outcome.NOT_FINAL), claim.tx_id
    if deadline is None:
        deadline = time.monotonic() + LOG_SEARCH_SECONDS
    try:
        found = chain.authorization_log(
            terms.payer, nonce, (claim.start_block or 0) - 5, head, log_range or log_block_range(), deadline
        )
    except LogSearchIncomplete as exc:
        log.info("settlement %s: log search out of time after block %d; goes on next time", settlement_id,
                 exc.searched_to)  # fmt: skip
        return Outcome.NOT_FINAL, None  # used (authorizationState says so) and not found yet: never released
    if found is None:
        # Used, but the log is out of our search range (or the RPC's log index lags: the search keeps no cursor,
        # so the next look asks every block again), and our own transaction did not execute it (yet): until the
        # transaction is found and final, the money may have moved: never release.
        log.warning("settlement %s: authorization used but its final transaction was not found yet", settlement_id)
        return Outcome.NOT_FINAL, None
    topic, tx_hash, block_number = found
    if not chain.is_final(block_number, head):
        return Outcome.NOT_FINAL, tx_hash  # executed (or cancelled), but a reorg may still undo it
    if topic != AUTHORIZATION_USED_TOPIC:
        return Outcome.CANCELED, tx_hash
    receipt = chain.receipt(tx_hash)
    if receipt is None or int(receipt["blockNumber"]) != block_number:
        log.warning("settlement %s: the receipt of %s is not (or elsewhere) on this node yet", settlement_id, tx_hash)
        return Outcome.NOT_FINAL, tx_hash  # a lagging node or a reorg under way: look again
    paid = _paid_this(chain, claim, receipt, nonce)
    if paid is None:
        # Not the token's layout (AuthorizationUsed, then its Transfer): we cannot tell what moved, so neither
        # pay (the merchant may have nothing) nor release (the buyer may have paid): an operator must look.
        log.error("settlement %s: cannot read what %s moved; left claimed", settlement_id, tx_hash)
        return Outcome.NOT_FINAL, tx_hash
    return (Outcome.USED if paid else Outcome.USED_ELSEWHERE), tx_hash


def can_never_execute(chain: EvmChain, claim: Claim, head: int, pins: MutableMapping[str, int] | None = None) -> bool:
    """Whether an authorization found unused (after reading ``head``) can never execute any more.

    The token executes it only in a block with ``timestamp < validBefore``. Once the newest final
    block (at ``head``) is past validBefore (+ grace), every block that is or can still become part
    of the chain comes after it and is later still: no reorg can bring back a block that executes it.
    """
    pins = {} if pins is None else pins
    if "final_time" not in pins:
        pins["final_time"] = chain.block_timestamp(chain.final_block(head))
    assert isinstance(claim.terms, EvmTerms)
    return not may_still_execute(claim.terms.valid_before, pins["final_time"])


def read_outcome(
    chain: EvmChain,
    claim: Claim,
    deadline: float | None = None,
    pins: MutableMapping[str, int] | None = None,
    with_cost: bool = True,
) -> ChainOutcome:
    """``onchain_outcome`` as the rail's answer: UNUSED past validBefore (+ grace) at the final block is EXPIRED;
    with the gas of our own mined transaction (``with_cost``), read first. ``pins``: the height (and the final
    block's time) of one watch tick, read once."""
    cost = None
    if with_cost and claim.tx_id and claim.relay_address:  # our mined transaction's gas, once it is mined
        cost = relay_cost(chain.receipt(claim.tx_id), claim.relay_address)
    if pins is None:
        head = chain.block_number()
    else:
        if "head" not in pins:
            pins["head"] = chain.block_number()  # read before any state or log of this tick
        head = pins["head"]
    outcome, tx_hash = onchain_outcome(chain, claim, head, deadline=deadline)
    detail = ""
    if outcome is Outcome.CANCELED:
        detail = CANCELED_DETAIL
    elif outcome is Outcome.USED_ELSEWHERE:
        detail = (
            f"the buyer's nonce was used by another authorization (other recipient or amount) in {tx_hash}; "
            "this one can never execute and the merchant received nothing from it"
        )
    elif outcome is Outcome.UNUSED and can_never_execute(chain, claim, head, pins):
        return ChainOutcome(Outcome.EXPIRED, None, EXPIRED_DETAIL, cost)
    return ChainOutcome(outcome, tx_hash, detail, cost)
