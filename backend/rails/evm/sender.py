"""The pipelined EVM submit: the last checks in one JSON-RPC batch, then a nonce of this process's relay account.

Many settle jobs of one relayer process send concurrently from the accounts it owns (``accounts.AccountPool``):
each account's ``NonceManager`` hands out nonces locally, so many transactions per account are in flight per block.
Before a nonce is taken, ONE batch asks: the payer's code (``eth_getCode``), the latest block (validAfter), the relay
account's balance and an ``eth_call`` of ``transferWithAuthorization`` from that account with ``GAS_LIMIT`` gas and
the fee fields it will be sent with (the simulation replaces ``eth_estimateGas``: the gas limit is fixed and checked).
The transaction's hash is recorded (``before_broadcast``) and handed to the shared watcher (with its signed bytes,
to broadcast again if the node drops it) before it is broadcast. The job then waits for it here (``wait_landed``),
replacing it at its nonce with higher fees when it stays unmined under fees the chain has outgrown (``_bump``).
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

from eth_account.signers.local import LocalAccount
from eth_utils import to_checksum_address
from redis import Redis
from web3.exceptions import Web3RPCError

from backend.chains.evm import EvmChain, evm_chain
from backend.chains.registry import Network
from backend.rails.base import (
    BeforeBroadcast,
    CannotSucceed,
    Claim,
    LeftOpen,
    RelayNonceTaken,
    Submission,
    TxStatus,
)
from backend.rails.evm.accounts import (
    AccountPool,
    LeaseLost,
    Owned,
    RecordedNonce,
    account_pool,
    broadcast,
    fill_nonce,
    node_answered,
)
from backend.rails.evm.nonces import replacement_fees
from backend.rails.evm.pipeline import shared_watcher
from backend.rails.evm.relay import (
    _GAS_ALLOWANCE,
    GAS_LIMIT,
    MAX_SEND_ATTEMPTS,
    NOT_YET_VALID,
    PAYER_CODE_REASON,
    PAYER_HAS_CODE,
    NotYetValid,
    RelayShortOfFunds,
    RelayUnavailable,
    Reverted,
    fees,
    final_refusal,
    relay_cost,
    transfer_call,
    valid_on_chain,
)
from backend.rails.evm.rpcbatch import call_many, quantity
from backend.rails.evm.terms import EvmTerms
from backend.rails.evm.watch import receipt_of, rpc_counter, status_of

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


class PayerHasCode(Exception):
    pass


class ChainBehind(Exception):
    """The latest block is not past validAfter yet."""


def presend(chain: EvmChain, call: Any, terms: EvmTerms, sender: str, fee_fields: dict[str, int]) -> None:
    """The last checks before a nonce is taken, in one batch: the payer's code (``PayerHasCode``), the latest block's
    time against validAfter (``ChainBehind``), the sender's balance against ``GAS_LIMIT`` at the fee cap
    (``RelayShortOfFunds``), and the transfer simulated from ``sender`` as it will be sent: ``Reverted`` when it
    cannot succeed, ``NotYetValid`` when the token says validAfter has not passed (``estimate``'s mapping)."""
    data = call._encode_transaction_data()
    simulated = {
        "from": to_checksum_address(sender),
        "to": chain.token.address,
        "data": data,
        "gas": hex(GAS_LIMIT),
        **{name: hex(int(value)) for name, value in fee_fields.items()},
    }
    code, block, balance, result = call_many(
        chain.w3,
        [
            ("eth_getCode", [to_checksum_address(terms.payer), "latest"]),
            ("eth_getBlockByNumber", ["latest", False]),
            ("eth_getBalance", [to_checksum_address(sender), "latest"]),
            ("eth_call", [simulated, "latest"]),
        ],
        rpc_counter(chain),
    )
    for answer, what in ((code, "eth_getCode"), (block, "eth_getBlockByNumber"), (balance, "eth_getBalance")):
        if not answer.ok:
            raise Web3RPCError(f"{what}: {answer.error}")  # as web3 raises an RPC's error: transient
    if str(code.result or "0x") not in ("0x", "0x0", ""):
        raise PayerHasCode()
    if not isinstance(block.result, Mapping) or quantity(block.result.get("timestamp")) <= terms.valid_after:
        raise ChainBehind()
    short = quantity(balance.result) < relay_cost(fee_fields)
    if short:
        raise RelayShortOfFunds(f"relay account {sender} cannot pay {GAS_LIMIT} gas at the fee cap")
    if result.ok:
        return
    message = str(result.error)
    lowered = message.lower()
    if NOT_YET_VALID in lowered:
        raise NotYetValid(message)
    if "insufficient funds" in lowered:  # the balance moved between the reads
        raise RelayShortOfFunds(f"relay account {sender} cannot pay {GAS_LIMIT} gas at the fee cap")
    reason = final_refusal(Web3RPCError(message))
    if reason is None:
        raise Web3RPCError(f"eth_call: {message}")  # transient: the job is tried again
    if any(part in lowered for part in _GAS_ALLOWANCE) and short:
        raise RelayShortOfFunds(f"relay account {sender} cannot pay {GAS_LIMIT} gas at the fee cap")
    raise Reverted(reason)


def submit(
    network: Network,
    claim: Claim,
    accounts: list[LocalAccount],
    leases: Redis,
    before_broadcast: BeforeBroadcast,
    recorded_nonce: RecordedNonce | None = None,
) -> Submission:
    """The last checks (``presend``), then the transfer from an account this process owns; raises a
    ``SubmitError`` as ``relay.submit`` did (a payer with code or a revert: ``CannotSucceed``; not valid yet or
    every relay account short of ETH: ``LeftOpen``)."""
    chain = evm_chain(network)
    terms = claim.terms
    assert isinstance(terms, EvmTerms)
    call = transfer_call(chain, terms)
    fee_fields = fees(chain)
    pool = account_pool(leases, chain, accounts, recorded_nonce)
    again = _send_again(chain, pool, claim, call, fee_fields, before_broadcast)
    if again is not None:
        return again
    try:
        return _send(chain, pool, call, terms, fee_fields, before_broadcast)
    except PayerHasCode:
        raise CannotSucceed(PAYER_CODE_REASON, PAYER_HAS_CODE) from None
    except Reverted as exc:  # the simulation, from the account that would send it
        raise CannotSucceed(f"the transfer would revert: {exc}") from None
    except (ChainBehind, NotYetValid):
        raise LeftOpen("validAfter has not passed on chain yet", "not-yet-valid") from None
    except RelayShortOfFunds as exc:
        # Our relay's trouble, never the payment's: left open (the reconciler sends it again) and said loudly.
        raise LeftOpen(f"waits: {exc}", "relay-short-of-eth", loud=True) from None


def _send_again(
    chain: EvmChain, pool: AccountPool, claim: Claim, call: Any, fee_fields: dict[str, int], record: BeforeBroadcast
) -> Submission | None:
    """The settlement's own transaction again, at its recorded (account, nonce) while that nonce may still be mined
    (the chain's latest count not past it): the same bytes when this process signed it, else the same transfer
    re-signed there when this process owns the account, else ``LeftOpen`` ("waiting-for-chain": the owner's
    repair step fills the nonce; a later attempt finds it consumed). None when a new nonce is safe (nothing
    recorded, or the recorded nonce is consumed and our transaction, which the caller found without a receipt,
    can never be mined)."""
    if not claim.tx_id or not claim.relay_address:
        return None
    address = to_checksum_address(claim.relay_address)
    raw = shared_watcher(chain).raw_of(claim.tx_id)
    if claim.relay_nonce is not None:
        if _consumed(chain, address, claim.relay_nonce):
            return None
        if raw is None:
            owned = pool.lease(address)  # its start, if leased now, fills its gaps (then this nonce is in flight)
            if owned is None:
                raise LeftOpen(f"nonce {claim.relay_nonce} of {address} is not consumed yet: its owner fills it",
                               "waiting-for-chain")  # fmt: skip
            if _consumed(chain, address, claim.relay_nonce):  # the start's cancel took it: mined
                return None
            taken = owned.manager.take_for_fill(claim.relay_nonce)
            if taken is None:
                raise LeftOpen(f"nonce {claim.relay_nonce} of {address} is being sent", "waiting-for-chain")
            if taken[0] == "resend" and taken[1] != claim.tx_id and not owned.manager.is_fill(taken[1]):
                # In flight there: neither this settlement's transaction nor a cancel of ours. Never replaced.
                raise LeftOpen(f"nonce {claim.relay_nonce} of {address} holds {taken[1]}", "waiting-for-chain")
            if taken[0] == "resend":
                owned.manager.reclaim(claim.relay_nonce)
            return _replace(chain, call, owned, claim.relay_nonce, fee_fields, record, None)
    if raw is None:
        return None
    owner = pool.lease(address)  # the same bytes only from an account this process surely holds
    try:
        if owner is None:
            raise LeaseLost(address)
        broadcast(chain, owner, raw)
    except LeaseLost:
        if claim.relay_nonce is not None:  # its nonce is not consumed: never a new one now
            raise LeftOpen(f"nonce {claim.relay_nonce} of {address} is not consumed yet: its owner fills it",
                           "waiting-for-chain") from None  # fmt: skip
        return None
    except Exception as exc:
        if "already known" not in str(exc).lower():
            if claim.relay_nonce is not None:  # its nonce is not consumed: never a new one now
                raise LeftOpen(f"{claim.tx_id} could not be sent again: {exc}", "waiting-for-chain") from None
            log.warning("settlement %s: its transaction %s could not be sent again (%s): a new one is sent",
                        claim.settlement_id, claim.tx_id, exc)  # fmt: skip
            return None
    log.warning("settlement %s: its transaction %s was sent again as it was", claim.settlement_id, claim.tx_id)
    return Submission(claim.tx_id, address)


def _consumed(chain: EvmChain, address: str, nonce: int) -> bool:
    return int(chain.w3.eth.get_transaction_count(to_checksum_address(address), "latest")) > nonce


def _send(
    chain: EvmChain,
    pool: AccountPool,
    call: Any,
    terms: EvmTerms,
    fee_fields: dict[str, int],
    before_broadcast: BeforeBroadcast,
) -> Submission:
    network = chain.network.network
    watcher = shared_watcher(chain)
    short: set[str] = set()
    attempt = 0
    waited = False
    while attempt < MAX_SEND_ATTEMPTS:
        if len(short) >= len({account.address for account in pool.accounts}):
            raise RelayShortOfFunds(f"every relay account of {network} is short of ETH: fund them")
        owned = pool.take(skip=frozenset(short))
        account, manager = owned.account, owned.manager
        try:
            presend(chain, call, terms, account.address, fee_fields)
        except ChainBehind:
            # Not before the chain's clock passes validAfter (docs/security.md): waited for a while, once.
            if waited or not valid_on_chain(chain, terms.valid_after):
                raise
            waited = True
            continue
        except RelayShortOfFunds:
            log.error("relay account %s of %s is short of ETH: fund it (another account is used)",
                      account.address, network)  # fmt: skip
            short.add(account.address)
            continue
        nonce = manager.allocate()
        try:
            signed = _sign(chain, call, account, nonce, fee_fields)
        except BaseException:
            manager.returned(nonce)  # never broadcast, and not recorded: the next send takes it
            raise
        tx_hash = "0x" + bytes(signed.hash).hex()
        if not owned.valid():  # the lease may be another process's now: nothing recorded, nothing sent
            manager.returned(nonce)
            raise LeftOpen(f"the lease of relay account {account.address} was not renewed in time", "lease-lost")
        try:
            before_broadcast(tx_hash, account.address, nonce)
        except RelayNonceTaken:
            # Another open settlement recorded this (account, nonce): another process sends from this account (a
            # lease lost unseen). Nothing is broadcast there, not even a cancel (it is the other's transaction's
            # nonce); the account is given up here (a later lease starts afresh) and the settlement left open.
            pool.lost(account.address)
            raise LeftOpen(f"nonce {nonce} of {account.address} is another settlement's", "lease-lost") from None
        except BaseException:
            # Maybe recorded (a commit that succeeded, then an error): never handed out again; a cancel fills it.
            fill_nonce(chain, owned, nonce)
            raise
        raw = bytes(signed.raw_transaction)
        if not owned.valid():
            # Lapsed while recording: nothing sent. Recorded, so never handed out again: the repair step fills it if
            # the lease is renewed late after all (else the account's next owner does, at its start).
            manager.unfilled(nonce)
            raise LeftOpen(f"the lease of relay account {account.address} was not renewed in time", "lease-lost")
        watcher.expect(tx_hash, raw, owned)  # before the broadcast: no head can hold it unread
        try:
            broadcast(chain, owned, raw)
        except LeaseLost:
            watcher.forget(tx_hash)
            manager.unfilled(nonce)
            lapsed = f"the lease of relay account {account.address} was not renewed in time"
            raise LeftOpen(lapsed, "lease-lost") from None
        except Exception as exc:
            message = str(exc).lower()
            if "already known" not in message:  # else: the very same transaction is in the pool
                if not node_answered(exc):
                    # A timeout or a dropped connection: the node may hold it. In flight; the watcher and the
                    # repair step send the same bytes again if the node turns out not to have it (no gap).
                    manager.sent(nonce, tx_hash)
                    raise
                watcher.forget(tx_hash)
                if "nonce too low" in message:  # taken on chain: the recorded one can never be mined
                    manager.consumed(nonce)
                    manager.resync()
                    attempt += 1
                    continue
                # The node answered: not taken. The nonce is recorded on this settlement: never returned (another
                # settlement would record it too), filled now so the account's later transactions do not wait.
                if "underpriced" in message or "replacement" in message:
                    return _replace(chain, call, owned, nonce, fee_fields, before_broadcast, exc)
                fill_nonce(chain, owned, nonce)
                reason = final_refusal(exc)
                if reason is not None:
                    raise CannotSucceed(f"the node refused it: {reason}") from None
                if "insufficient funds" in message:  # its balance fell since the check
                    raise LeftOpen(f"waits: relay account {account.address} short of ETH", "relay-short-of-eth",
                                   loud=True) from None  # fmt: skip
                raise LeftOpen(f"the node did not take it: {exc}", "node-refused") from None
        manager.sent(nonce, tx_hash)
        _remember(tx_hash, _Sent(owned, call, nonce, fee_fields, int(fee_fields["maxFeePerGas"]), before_broadcast))
        return Submission(tx_hash, account.address)
    raise RelayUnavailable("could not send the transaction")


def _sign(chain: EvmChain, call: Any, account: LocalAccount, nonce: int, fee_fields: dict[str, int]) -> Any:
    tx = call.build_transaction(
        {"from": account.address, "nonce": nonce, "gas": GAS_LIMIT, "chainId": chain.network.chain_id, **fee_fields}
    )
    return account.sign_transaction(tx)


def _replace(
    chain: EvmChain,
    call: Any,
    owned: Owned,
    nonce: int,
    old_fees: dict[str, int],
    before_broadcast: BeforeBroadcast,
    refusal: Exception | None,
) -> Submission:
    """The same transfer signed again at the same (allocated, recorded) nonce with ``replacement_fees`` after an
    "underpriced" refusal: its hash recorded first, then broadcast. A failed attempt leaves the nonce to the repair
    step (an answer: ``unfilled``) or in flight (a timeout); the settlement is left open. Broadcast only while the
    lease is surely ours (checked right before)."""
    account, manager = owned.account, owned.manager
    watcher = shared_watcher(chain)
    try:
        # The fee read is an RPC: inside, so a failure fills the nonce too (else it stayed allocated for good, never
        # given to the repair step, and every later nonce of the account waited behind it).
        new_fees = replacement_fees(old_fees, fees(chain), None)
        assert new_fees is not None  # no cap: always a bump
        signed = _sign(chain, call, account, nonce, new_fees)
        tx_hash = "0x" + bytes(signed.hash).hex()
        before_broadcast(tx_hash, account.address, nonce)
    except RelayNonceTaken:
        # Another open settlement's nonce: never replaced nor cancelled from here (its owner sends or fills it).
        raise LeftOpen(f"nonce {nonce} of {account.address} is another settlement's", "waiting-for-chain") from None
    except BaseException:
        fill_nonce(chain, owned, nonce)
        raise
    raw = bytes(signed.raw_transaction)
    watcher.expect(tx_hash, raw, owned)
    try:
        broadcast(chain, owned, raw)
    except LeaseLost:
        watcher.forget(tx_hash)
        manager.unfilled(nonce)  # recorded: the repair step (a renewed lease) or the account's next owner fills it
        raise LeftOpen(f"the lease of relay account {account.address} is not surely ours", "lease-lost") from None
    except Exception as exc:
        if "already known" not in str(exc).lower():
            if not node_answered(exc):
                manager.sent(nonce, tx_hash)
                raise
            watcher.forget(tx_hash)
            if "nonce too low" in str(exc).lower():
                manager.consumed(nonce)  # mined meanwhile (a cancel): the next attempt takes a new nonce
            else:
                manager.unfilled(nonce)  # the repair step fills it
            raise LeftOpen(f"the node did not take it ({refusal or 'no bytes'}; then {exc})", "node-refused") from None
    manager.sent(nonce, tx_hash)
    _remember(tx_hash, _Sent(owned, call, nonce, new_fees, int(old_fees["maxFeePerGas"]), before_broadcast))
    log.warning("relay nonce %d of %s: refused as underpriced, the transfer sent again there as %s", nonce,
                account.address, tx_hash)  # fmt: skip
    return Submission(tx_hash, account.address)


# Replacing a stuck transaction with higher fees (docs/architecture.md, "The pipelined EVM relay": "Replace").


@dataclass
class _Sent:
    """What the job that sent a transfer needs to replace it at its nonce while it waits for it."""

    owned: Owned
    call: Any
    nonce: int
    fees: dict[str, int]  # the newest transaction's
    first_fee_cap: int  # the settlement's first transaction's maxFeePerGas (the cap's base)
    record: BeforeBroadcast  # the submit's ``before_broadcast`` (``mark_submitted``), in the job's thread
    at: float = dataclasses.field(default_factory=time.monotonic)
    capped: bool = False  # said loudly once: at the cap, not bumped further
    stopped: bool = False  # not bumped again by this job (the node refused one, the authorization expired, ...)
    consumed: bool = False  # the nonce is mined (ours, or another transaction: the repair step's cancel)


_sent: dict[str, _Sent] = {}
_sent_lock = threading.Lock()
_SENT_KEEP_SECONDS = 3600.0  # a job that never waited (an error between submit and wait) leaves no entry for good


def _remember(tx_hash: str, sent: _Sent) -> None:
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


def wait_landed(chain: EvmChain, claim: Claim, timeout: float) -> TxStatus | None:
    """Wait on the shared watcher for the claim's transaction to be mined. When this job sent it (``submit`` in
    this thread) and it stays unmined for ``EVM_REPLACE_AFTER`` new heads with fees below what the chain now asks,
    it is replaced at its (account, nonce) with ``replacement_fees`` (recorded first, as every new hash), and every
    transaction of the settlement at that nonce is waited for: the chain mines one of them. The status's ``tx_id``
    names the one mined."""
    if not claim.tx_id:
        return None
    watcher = shared_watcher(chain)
    with _sent_lock:
        sent = _sent.pop(claim.tx_id.lower(), None)
    if sent is None:  # not sent by this job (a retry): waited for as it is
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
            replacement = _bump(chain, sent, hashes[-1], cap, valid_before)
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
    head = chain.block_number() if chain.network.confirmations > 1 else None
    answers = call_many(chain.w3, [("eth_getTransactionReceipt", [h]) for h in hashes], rpc_counter(chain))
    for tx_hash, answer in zip(hashes, answers, strict=True):
        if not answer.ok:
            raise ValueError(answer.error)
        receipt = receipt_of(answer.result)
        if receipt is not None:
            return tx_hash.lower(), status_of(chain, receipt, head)
    return None


def _bump(chain: EvmChain, sent: _Sent, current_hash: str, cap: int, valid_before: int | None) -> str | None:
    """Replace ``current_hash`` (unmined) at its nonce if its fees are below the chain's now: the new hash recorded
    (``sent.record``), handed to the watcher, then broadcast while the lease is surely ours. None when it is left
    as it is (its fees still suffice, at the cap, the lease not surely ours, the node refused the replacement);
    the transaction in flight stands in every case (nothing here fills or cancels the nonce). Never once the nonce
    is consumed (``sent.consumed``: the wait then ends), nor after a refusal or past the authorization's
    validBefore (``sent.stopped``: the replacement could only revert)."""
    account, manager = sent.owned.account, sent.owned.manager
    if _consumed(chain, account.address, sent.nonce):
        sent.consumed = True  # mined: ours (the watcher tells which) or another (the repair step's cancel)
        return None
    if sent.stopped:
        return None
    if valid_before is not None and chain.block_timestamp("latest") >= valid_before:
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
    signed = _sign(chain, sent.call, account, sent.nonce, new_fees)
    tx_hash = "0x" + bytes(signed.hash).hex()
    # Recorded before the broadcast (a crash after it leaves the row naming a transaction that may be mined). A
    # failure here leaves the row naming either hash; both are at the recorded nonce, and the settlement is finished
    # by the authorization's use on chain (``settle_from_chain``), whichever executed it. Record first, then put
    # back on a sure refusal (below) is the simplest order that is right on a crash at any point: recording after
    # the broadcast would leave a crash window where the row does not name a transaction that may be mined.
    sent.record(tx_hash, account.address, sent.nonce)
    raw = bytes(signed.raw_transaction)
    watcher = shared_watcher(chain)
    watcher.expect(tx_hash, raw, sent.owned)
    try:
        broadcast(chain, sent.owned, raw)
    except LeaseLost:  # raised before sending: the replacement went nowhere
        watcher.forget(tx_hash)
        sent.stopped = True  # before the put-back: a failing write must not start the bump again each round
        sent.record(current_hash, account.address, sent.nonce)  # the row back on the one in flight
        log.warning("relay nonce %d of %s: the lease is not surely ours, %s not replaced", sent.nonce,
                    account.address, current_hash)  # fmt: skip
        return None
    except Exception as exc:
        message = str(exc).lower()
        if "already known" not in message and node_answered(exc):
            # Not taken, and in no pool (the node answered): the row back on the last hash broadcast. A sure refusal
            # ends this job's bumps ("nonce too low": the nonce is mined, by ours or a cancel: the wait ends;
            # "insufficient funds", underpriced against our own cancel: retrying each round would not help); any
            # other answer (a rate limit, a full pool) is tried again at the next look. The flags are set before
            # the put-back: a failing write must not start the bump again each round.
            watcher.forget(tx_hash)
            sent.stopped = any(refusal in message for refusal in SURE_REFUSALS)
            sent.consumed = "nonce too low" in message
            sent.record(current_hash, account.address, sent.nonce)
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
