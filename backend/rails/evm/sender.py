"""The pipelined EVM submit: the last checks in one JSON-RPC batch, then a nonce of this process's relay account.

Many settle jobs of one relayer process send concurrently from the accounts it owns (``accounts.AccountPool``):
each account's ``NonceManager`` hands out nonces locally, so many transactions per account are in flight per block.
Before a nonce is taken, ONE batch asks: the payer's code (``eth_getCode``), the latest block (validAfter), the relay
account's balance and an ``eth_call`` of ``transferWithAuthorization`` from that account with ``GAS_LIMIT`` gas and
the fee fields it will be sent with (the simulation replaces ``eth_estimateGas``: the gas limit is fixed and checked).
The transaction's hash is recorded (``before_broadcast``) and handed to the shared watcher (with its signed bytes,
to broadcast again if the node drops it) before it is broadcast. The job then waits for it in ``feebump``
(``wait_landed``), which replaces it at its nonce with higher fees when it stays unmined under fees the chain has
outgrown.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
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
)
from backend.rails.evm.accounts import AccountPool, RecordedNonce, account_pool, fill_nonce
from backend.rails.evm.feebump import Sent, remember
from backend.rails.evm.fence import LeaseLost, Owned, broadcast, node_answered
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
    already_known,
    fees,
    final_refusal,
    relay_cost,
    sign_transfer,
    transfer_call,
    valid_on_chain,
)
from backend.rails.evm.rpcbatch import call_many, quantity
from backend.rails.evm.terms import EvmTerms
from backend.rails.evm.watch import rpc_counter

log = logging.getLogger(__name__)


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
            # Leased now: its start fills its other gaps and leaves this one to the transfer below.
            owned = pool.lease(address, keep=claim.relay_nonce)
            if owned is None:
                raise LeftOpen(f"nonce {claim.relay_nonce} of {address} is not consumed yet: its owner fills it",
                               "waiting-for-chain")  # fmt: skip
            if _consumed(chain, address, claim.relay_nonce):  # taken meanwhile (the repair step's cancel): mined
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
        if not already_known(exc):
            if claim.relay_nonce is not None:  # its nonce is not consumed: never a new one now
                raise LeftOpen(f"{claim.tx_id} could not be sent again: {exc}", "waiting-for-chain") from None
            log.warning("settlement %s: its transaction %s could not be sent again (%s): a new one is sent",
                        claim.settlement_id, claim.tx_id, exc)  # fmt: skip
            return None
    log.warning("settlement %s: its transaction %s was sent again as it was", claim.settlement_id, claim.tx_id)
    return Submission(claim.tx_id, address, claim.relay_nonce)


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
            signed = sign_transfer(chain, call, account, nonce, fee_fields)
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
            if not already_known(exc):  # else: the very same transaction is in the pool
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
        remember(tx_hash, Sent(owned, call, nonce, fee_fields, int(fee_fields["maxFeePerGas"])))
        return Submission(tx_hash, account.address, nonce)
    raise RelayUnavailable("could not send the transaction")


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
        signed = sign_transfer(chain, call, account, nonce, new_fees)
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
        if not already_known(exc):
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
    remember(tx_hash, Sent(owned, call, nonce, new_fees, int(old_fees["maxFeePerGas"])))
    log.warning("relay nonce %d of %s: refused as underpriced, the transfer sent again there as %s", nonce,
                account.address, tx_hash)  # fmt: skip
    return Submission(tx_hash, account.address, nonce)
