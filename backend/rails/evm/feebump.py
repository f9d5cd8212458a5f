"""The EVM fee bump: the job that sent a transfer (``sender.submit``) waits for it here (``wait_landed``), replacing
it at its nonce with higher fees when it stays unmined under fees the chain has outgrown (``_bump``).

``sender`` hands each transaction it broadcast to this module (``remember``); a job waiting for a transaction it
did not send (a retry) waits for it as it is. docs/architecture.md, "The pipelined EVM relay": "Replace".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from eth_utils import to_checksum_address
from web3.exceptions import Web3RPCError

from backend.chains.evm import EvmChain
from backend.rails.base import Claim, Rerecord, TxStatus
from backend.rails.evm.fence import LeaseLost, Owned, broadcast, node_answered
from backend.rails.evm.nonces import replacement_fees
from backend.rails.evm.pipeline import shared_watcher
from backend.rails.evm.relay import already_known, fees, sign_transfer
from backend.rails.evm.rpcbatch import call_many, strict_quantity
from backend.rails.evm.terms import EvmTerms
from backend.rails.evm.watch import mined_receipts, rpc_counter

log = logging.getLogger(__name__)

# A transaction of ours pending this many new heads with fees below what the chain now asks (``fees``) is replaced at
# its nonce with higher fees (``replacement_fees``) by the job waiting for it (``wait_landed``).
REPLACE_AFTER_ENV = "EVM_REPLACE_AFTER"
DEFAULT_REPLACE_AFTER = 3
# No replacement's maxFeePerGas goes above this many times the settlement's first transaction's: a fee spike cannot
# drain the relay account; at the cap the transaction is left as it is, loudly.
MAX_FEE_MULTIPLE_ENV = "EVM_REPLACE_MAX_FEE_MULTIPLE"
DEFAULT_MAX_FEE_MULTIPLE = Fraction(4)
# Heads a job still waits, once its nonce is consumed, for the watcher to report which of its transactions was mined;
# none was: another transaction took the nonce (the repair step's cancel), the settlement is left to the retry.
CONSUMED_GRACE_HEADS = 2
# A node's answers to a replacement that no retry by this job can change (anything else: tried again later).
SURE_REFUSALS = ("nonce too low", "insufficient funds", "underpriced", "replacement transaction")


@dataclass
class Sent:
    """What the job that sent a transfer needs to replace it at its nonce while it waits for it."""

    owned: Owned
    call: Any
    nonce: int
    fees: dict[str, int]  # the newest transaction's
    first_fee_cap: int  # the settlement's first transaction's maxFeePerGas (the cap's base)
    at: float = dataclasses.field(default_factory=time.monotonic)
    capped: bool = False  # said loudly once: at the cap, not bumped further
    stopped: bool = False  # not bumped again by this job (the node refused one, the authorization expired, ...)
    consumed: bool = False  # the nonce is mined (ours, or another transaction: the repair step's cancel)


_sent: dict[str, Sent] = {}
_sent_lock = threading.Lock()
_SENT_KEEP_SECONDS = 3600.0  # a job that never waited (an error between submit and wait) leaves no entry for good


def remember(tx_hash: str, sent: Sent) -> None:
    """A transaction ``sender`` broadcast, for the job that sent it to replace while it waits (``wait_landed``)."""
    now = time.monotonic()
    with _sent_lock:
        for key in [k for k, v in _sent.items() if now - v.at > _SENT_KEEP_SECONDS]:
            del _sent[key]
        _sent[tx_hash.lower()] = sent


def replace_after() -> int:
    """``EVM_REPLACE_AFTER`` (an integer >= 1); a bad value is said loudly and the default used: it is read after
    the broadcast, where raising would leave the job erring with its transaction in flight."""
    text = os.environ.get(REPLACE_AFTER_ENV, "").strip()
    if not text:
        return DEFAULT_REPLACE_AFTER
    if text.isdigit() and int(text) >= 1:
        return int(text)
    log.error("%s=%r is not an integer >= 1: %d used", REPLACE_AFTER_ENV, text, DEFAULT_REPLACE_AFTER)
    return DEFAULT_REPLACE_AFTER


def max_fee_multiple() -> Fraction:
    """``EVM_REPLACE_MAX_FEE_MULTIPLE`` as an exact fraction (a finite decimal > 1; never a float in the fee math);
    a bad value is said loudly and the default used (read after the broadcast: never raises)."""
    text = os.environ.get(MAX_FEE_MULTIPLE_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_FEE_MULTIPLE
    try:
        number = Decimal(text)
    except InvalidOperation:
        number = Decimal(0)
    if not number.is_finite() or number <= 1 or number > 1000:
        log.error("%s=%r is not a number in (1, 1000]: %s used", MAX_FEE_MULTIPLE_ENV, text, DEFAULT_MAX_FEE_MULTIPLE)
        return DEFAULT_MAX_FEE_MULTIPLE
    return Fraction(number)


def wait_landed(chain: EvmChain, claim: Claim, timeout: float, rerecord: Rerecord | None = None) -> TxStatus | None:
    """Wait on the shared watcher for the claim's transaction to be mined. When this job sent it (``submit`` in
    this thread) and it stays unmined for ``EVM_REPLACE_AFTER`` new heads with fees below what the chain now asks,
    it is replaced at its (account, nonce) with ``replacement_fees`` (recorded first with ``rerecord``, only while
    the row still names the transaction it replaces there), and every transaction of the settlement at that nonce
    is waited for: the chain mines one of them. The status's ``tx_id`` names the one mined."""
    if not claim.tx_id:
        return None
    watcher = shared_watcher(chain)
    with _sent_lock:
        sent = _sent.pop(claim.tx_id.lower(), None)
    if sent is None or rerecord is None:  # not sent by this job (a retry), or nothing to record with: as it is
        return watcher.wait(claim.tx_id, timeout)
    every = replace_after()
    multiple = max_fee_multiple()
    cap = sent.first_fee_cap * multiple.numerator // multiple.denominator  # integers only (floor)
    valid_before = claim.terms.valid_before if isinstance(claim.terms, EvmTerms) else None
    hashes = [claim.tx_id]
    deadline = time.monotonic() + timeout
    since: int | None = None  # the head from which new heads are counted (the first seen, then each look)
    consumed_at: int | None = None  # the head at which the nonce was seen consumed
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        got = watcher.wait_any(hashes, min(left, 1.0))
        if got is not None:
            mined, status = got
            for other in hashes:
                if other.lower() != mined:
                    watcher.forget(other)  # its nonce is mined: it can never be (a reorg: the chain decides again)
            return dataclasses.replace(status, tx_id=mined if mined != claim.tx_id.lower() else None)
        head = watcher.blocks.head
        if head is None:
            continue
        if consumed_at is not None:
            if head - consumed_at < CONSUMED_GRACE_HEADS:
                continue
            # The watcher's receipts may lag (a load balancer, rate limits): ours are asked for directly first.
            try:
                found = _mined_among(chain, hashes)
            except Exception as exc:  # cannot tell now: looked at again next round
                log.warning("relay nonce %d of %s: receipts not read (%s)", sent.nonce, sent.owned.account.address,
                            type(exc).__name__)  # fmt: skip
                continue
            if found is not None:
                mined, status = found
                for other in hashes:
                    if other.lower() != mined:
                        watcher.forget(other)
                return dataclasses.replace(status, tx_id=mined if mined != claim.tx_id.lower() else None)
            # None of ours mined at the consumed nonce: another transaction took it (the repair step's cancel). Not
            # waited out to the timeout: the retry (reconciler) sends the settlement again at a new nonce.
            log.warning("relay nonce %d of %s: taken by a transaction other than %s; the settlement is left to its "
                        "retry", sent.nonce, sent.owned.account.address, hashes)  # fmt: skip
            for other in hashes:
                watcher.forget(other)  # never broadcast again: their nonce is taken
            return None
        if since is None or head < since:
            since = head
        if head - since < every:
            continue
        since = head
        try:
            replacement = _bump(chain, sent, rerecord, hashes[-1], cap, valid_before)
        except Exception as exc:  # an RPC hiccup: the transaction in flight stands; looked at again later
            log.warning("relay nonce %d of %s: no replacement now (%s)", sent.nonce, sent.owned.account.address,
                        type(exc).__name__)  # fmt: skip
            continue
        if sent.consumed:
            consumed_at = head
        elif replacement is not None:
            hashes.append(replacement)


def _mined_among(chain: EvmChain, hashes: list[str]) -> tuple[str, TxStatus] | None:
    """The one of ``hashes`` (one nonce's transactions) with a receipt, read from the node now, and its status."""
    mined = mined_receipts(chain, hashes)
    for tx_hash in hashes:
        status = mined.get(tx_hash.lower())
        if status is not None:
            return tx_hash.lower(), status
    return None


def _look(chain: EvmChain, address: str, nonce: int, timed: bool) -> tuple[bool, int | None]:
    """Whether ``nonce`` of ``address`` is consumed (the chain's latest count past it) and, when ``timed``, the
    latest block's time, in one round trip (a JSON-RPC batch): each bump round's only reads besides the fees (cached,
    ``relay.fees``). An RPC error or a malformed answer raises (the round is looked at again later)."""
    calls: list[tuple[str, list[Any]]] = [("eth_getTransactionCount", [to_checksum_address(address), "latest"])]
    if timed:
        calls.append(("eth_getBlockByNumber", ["latest", False]))
    answers = call_many(chain.w3, calls, rpc_counter(chain))
    for answer, (method, _) in zip(answers, calls, strict=True):
        if not answer.ok:
            raise Web3RPCError(f"{method}: {answer.error}")  # as web3 raises an RPC's error
    consumed = strict_quantity(answers[0].result) > nonce
    if not timed:
        return consumed, None
    block = answers[1].result
    if not isinstance(block, Mapping):
        raise ValueError("no latest block")
    return consumed, strict_quantity(block.get("timestamp"))


def _bump(
    chain: EvmChain, sent: Sent, rerecord: Rerecord, current_hash: str, cap: int, valid_before: int | None
) -> str | None:
    """Replace ``current_hash`` (unmined) at its nonce if its fees are below the chain's now: the new hash recorded
    (``rerecord``: only while the row still names ``current_hash`` at the nonce), handed to the watcher, then
    broadcast while the lease is surely ours. None when it is left as it is (its fees still suffice, at the cap,
    the lease not surely ours, the row moved, the node refused the replacement); the transaction in flight stands
    in every case (nothing here fills or cancels the nonce). Never once the nonce is consumed (``sent.consumed``:
    the wait then ends), nor after a refusal, a moved row or past the authorization's validBefore
    (``sent.stopped``: the replacement could only revert, or would overwrite another attempt's record)."""
    account, manager = sent.owned.account, sent.owned.manager
    consumed, latest_time = _look(chain, account.address, sent.nonce, not sent.stopped and valid_before is not None)
    if consumed:
        sent.consumed = True  # mined: ours (the watcher tells which) or another (the repair step's cancel)
        return None
    if sent.stopped:
        return None
    if valid_before is not None and latest_time is not None and latest_time >= valid_before:
        sent.stopped = True
        log.warning("relay nonce %d of %s: %s is past its authorization's validBefore: not replaced (it can only "
                    "revert now)", sent.nonce, account.address, current_hash)  # fmt: skip
        return None
    current = fees(chain)
    old_cap, old_tip = int(sent.fees["maxFeePerGas"]), int(sent.fees["maxPriorityFeePerGas"])
    if old_cap >= int(current["maxFeePerGas"]) and old_tip >= int(current["maxPriorityFeePerGas"]):
        return None  # priced as the chain asks: it waits its turn
    new_fees = replacement_fees(sent.fees, current, cap)
    if new_fees is None:
        if not sent.capped:
            sent.capped = True
            log.error("relay nonce %d of %s: %s is stuck under the chain's fees (%s) and its replacement would pass "
                      "the fee cap (%d wei per gas, %s x the first): left as it is", sent.nonce, account.address,
                      current_hash, current, cap, MAX_FEE_MULTIPLE_ENV)  # fmt: skip
        return None
    if not sent.owned.valid():
        return None  # the lease may be another process's: nothing recorded, nothing sent
    signed = sign_transfer(chain, sent.call, account, sent.nonce, new_fees)
    tx_hash = "0x" + bytes(signed.hash).hex()
    # Recorded before the broadcast (a crash after it leaves the row naming a transaction that may be mined). A
    # failure here leaves the row naming either hash; both are at the recorded nonce, and the settlement is finished
    # by the authorization's use on chain (``settle_from_chain``), whichever executed it. Record first, then put
    # back on a sure refusal (below) is the simplest order that is right on a crash at any point: recording after
    # the broadcast would leave a crash window where the row does not name a transaction that may be mined.
    # Only while the row still names ``current_hash`` at this (account, nonce): after a lock loss another attempt may
    # have recorded its own transaction since this round's look; its record stands and nothing is broadcast here.
    if not rerecord(current_hash, tx_hash, account.address, sent.nonce):
        sent.stopped = True
        log.warning("relay nonce %d of %s: the settlement's row no longer names %s there (another attempt recorded "
                    "it): %s never broadcast, no more replacements", sent.nonce, account.address, current_hash,
                    tx_hash)  # fmt: skip
        return None
    raw = bytes(signed.raw_transaction)
    watcher = shared_watcher(chain)
    watcher.expect(tx_hash, raw, sent.owned)
    try:
        broadcast(chain, sent.owned, raw)
    except LeaseLost:  # raised before sending: the replacement went nowhere
        watcher.forget(tx_hash)
        sent.stopped = True  # before the put-back: a failing write must not start the bump again each round
        _put_back(rerecord, sent, tx_hash, current_hash)  # back on the one in flight
        log.warning("relay nonce %d of %s: the lease is not surely ours, %s not replaced", sent.nonce,
                    account.address, current_hash)  # fmt: skip
        return None
    except Exception as exc:
        message = str(exc).lower()
        if not already_known(exc) and node_answered(exc):
            # Not taken, and in no pool (the node answered): the row back on the last hash broadcast. A sure refusal
            # ends this job's bumps ("nonce too low": the nonce is mined, by ours or a cancel: the wait ends;
            # "insufficient funds", underpriced against our own cancel: retrying each round would not help); any
            # other answer (a rate limit, a full pool) is tried again at the next look. The flags are set before
            # the put-back: a failing write must not start the bump again each round.
            watcher.forget(tx_hash)
            sent.stopped = any(refusal in message for refusal in SURE_REFUSALS)
            sent.consumed = "nonce too low" in message
            _put_back(rerecord, sent, tx_hash, current_hash)
            log.warning("relay nonce %d of %s: the node did not take the replacement of %s: %s", sent.nonce,
                        account.address, current_hash, exc)  # fmt: skip
            return None
        # Else the node has it, or may (a timeout): it is in flight with the one it replaces.
    manager.sent(sent.nonce, tx_hash)
    watcher.replaced(current_hash)
    log.warning("relay nonce %d of %s: %s stuck under the chain's fees (%s), replaced by %s with %s", sent.nonce,
                account.address, current_hash, current, tx_hash, new_fees)  # fmt: skip
    sent.fees = new_fees
    return tx_hash


def _put_back(rerecord: Rerecord, sent: Sent, never_sent: str, in_flight: str) -> None:
    """The row back on ``in_flight`` after its replacement ``never_sent`` went nowhere: only while the row still
    names ``never_sent`` (another attempt's record since, even at this nonce, stands), said when it does not."""
    if not rerecord(never_sent, in_flight, sent.owned.account.address, sent.nonce):
        log.warning("relay nonce %d of %s: the settlement's row no longer names %s: not put back on %s (another "
                    "attempt recorded it)", sent.nonce, sent.owned.account.address, never_sent, in_flight)  # fmt: skip
