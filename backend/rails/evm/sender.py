"""The pipelined EVM submit: the last checks in one JSON-RPC batch, then a nonce of this process's relay account.

Many settle jobs of one relayer process send concurrently from the accounts it owns (``accounts.AccountPool``):
each account's ``NonceManager`` hands out nonces locally, so many transactions per account are in flight per block.
Before a nonce is taken, ONE batch asks: the payer's code (``eth_getCode``), the latest block (validAfter), the relay
account's balance and an ``eth_call`` of ``transferWithAuthorization`` from that account with ``GAS_LIMIT`` gas and
the fee fields it will be sent with (the simulation replaces ``eth_estimateGas``: the gas limit is fixed and checked).
The transaction's hash is recorded (``before_broadcast``) and handed to the shared watcher (with its signed bytes,
to broadcast again if the node drops it) before it is broadcast.
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
from backend.rails.base import BeforeBroadcast, CannotSucceed, Claim, LeftOpen, Submission
from backend.rails.evm.accounts import AccountPool, RecordedNonce, account_pool
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
    again = _send_again(chain, claim)
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


def _send_again(chain: EvmChain, claim: Claim) -> Submission | None:
    """The settlement's own transaction sent again, when this process signed it and the node lost it (a retry
    found it UNKNOWN): the same bytes at the same (account, nonce), so at most one of its transactions can be mined
    and nothing is recorded again. None when this process has no such transaction or its nonce is taken."""
    if not claim.tx_id or not claim.relay_address:
        return None
    raw = shared_watcher(chain).raw_of(claim.tx_id)
    if raw is None:
        return None
    try:
        chain.w3.eth.send_raw_transaction(raw)
    except Exception as exc:
        if "already known" not in str(exc).lower():
            log.warning("settlement %s: its transaction %s could not be sent again (%s): a new one is sent",
                        claim.settlement_id, claim.tx_id, exc)  # fmt: skip
            return None
    log.warning("settlement %s: its transaction %s was sent again as it was", claim.settlement_id, claim.tx_id)
    return Submission(claim.tx_id, claim.relay_address)


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
            tx = call.build_transaction(
                {
                    "from": account.address,
                    "nonce": nonce,
                    "gas": GAS_LIMIT,
                    "chainId": chain.network.chain_id,
                    **fee_fields,
                }
            )
            signed = account.sign_transaction(tx)
            tx_hash = "0x" + bytes(signed.hash).hex()
            before_broadcast(tx_hash, account.address, nonce)
        except BaseException:
            manager.returned(nonce)  # never broadcast, and not recorded: the next send takes it
            raise
        raw = bytes(signed.raw_transaction)
        watcher.expect(tx_hash, raw)  # before the broadcast: no head can hold it unread
        try:
            chain.w3.eth.send_raw_transaction(raw)
        except Exception as exc:
            message = str(exc).lower()
            if "already known" not in message:  # else: the very same transaction is in the pool
                reason = final_refusal(exc)
                if reason is not None or "insufficient funds" in message:
                    watcher.forget(tx_hash)
                    manager.returned(nonce)  # the node did not take it: no gap
                    if reason is not None:
                        raise CannotSucceed(f"the node refused it: {reason}") from None
                    short.add(account.address)  # its balance fell since the check: another account
                    continue
                if "nonce too low" in message or "replacement transaction underpriced" in message:
                    watcher.forget(tx_hash)  # its nonce is taken on chain or in the pool: read the chain again
                    manager.resync()
                    attempt += 1
                    continue
                # A timeout or a dropped connection: the node may hold it. In flight; the watcher sends the same
                # bytes again if the node turns out not to have it (so its nonce leaves no gap).
                manager.sent(nonce, tx_hash)
                raise
        manager.sent(nonce, tx_hash)
        return Submission(tx_hash, account.address)
    raise RelayUnavailable("could not send the transaction")
