"""Submitting ``transferWithAuthorization`` from relay accounts: leases, nonces, fees.

Several relay accounts per chain are used in parallel: a job leases a free account (a Redis lock),
takes its next nonce, signs and broadcasts, then releases the lease before waiting for the
receipt. The next nonce lives in Redis and is reconciled with the chain's pending count on every
lease, so it survives restarts and transactions sent by anyone else.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any

from eth_account.signers.local import LocalAccount
from eth_typing import HexStr
from eth_utils import to_checksum_address
from redis import Redis
from web3.exceptions import ContractLogicError, Web3RPCError

from backend.chains.evm import EvmChain
from backend.rails.evm.terms import EvmTerms
from backend.relaybudget.services import EVM_SETTLEMENT_GAS
from backend.settlement.models import Settlement, settlement_terms

log = logging.getLogger(__name__)
LEASE_SECONDS = 120  # longer than the RPC calls and the database write a send makes
NONCE_KEY = "payintent:relayer:last:{}:{}"  # the last transaction sent from an account: "nonce:hash"
LEASE_KEY = "payintent:relayer:lease:{}:{}"
PRIORITY_FEE_WEI = 1_000_000_000  # 1 gwei tip when the node does not suggest one
# The gas limit of every relay transaction, whatever the estimate says: transferWithAuthorization uses
# 60,000-90,000 (USDC's FiatToken, our TestUSDC), so a payer's code cannot make the relay burn more than
# this (docs/security.md, "Payers with contract code"). The relay budget reserves the same amount.
GAS_LIMIT = EVM_SETTLEMENT_GAS
MAX_SEND_ATTEMPTS = 4
# What a node answers when the transaction cannot succeed whenever it is sent again (lowercase parts of
# the message): the settlement then fails for good instead of being retried. "gas required exceeds
# (allowance)" and "out of gas" mean "more than GAS_LIMIT" only when the sender can pay GAS_LIMIT at the fee
# cap (the node caps the allowance by the sender's balance): ``estimate`` checks that first (``RelayShortOfFunds``).
FINAL_REFUSALS = (
    "execution reverted",
    "revert",
    "invalid signature",
    "authorization is used",
    "authorization is expired",
    "gas required exceeds",
    "out of gas",
)
# The token's "authorization is not yet valid" (block.timestamp <= validAfter): the chain's clock has not
# reached validAfter yet; the same transaction succeeds a few blocks later. Never final (checked first: the
# node's answer also says "execution reverted").
NOT_YET_VALID = "not yet valid"
_GAS_ALLOWANCE = ("gas required exceeds", "out of gas")


class RelayUnavailable(RuntimeError):
    pass


class RelayShortOfFunds(RelayUnavailable):
    """The relay account (or every one) cannot pay GAS_LIMIT at the fee cap: transient, never the payment's fault."""


class NotYetValid(RuntimeError):
    """The chain's latest block is not past validAfter yet: transient, the settlement is tried again."""


class Reverted(RuntimeError):
    """The call would revert (or did): the authorization was not executed."""


class Refused(Reverted):
    """The node refused to take the transaction for a reason that sending it again does not change."""


def final_refusal(exc: BaseException) -> str | None:
    """The node's reason if ``exc`` is its answer that the call cannot succeed (a revert, a bad or used
    authorization, more gas than the cap); None for anything else (a timeout, a dropped connection, a
    nonce race, a relay short of funds, an authorization not valid *yet*), which may pass if tried again."""
    if isinstance(exc, ContractLogicError):
        message = str(exc.message or exc)
        return None if NOT_YET_VALID in message.lower() else message
    if isinstance(exc, Web3RPCError | ValueError):
        message = str(getattr(exc, "message", None) or exc)
        lowered = message.lower()
        if NOT_YET_VALID not in lowered and any(part in lowered for part in FINAL_REFUSALS):
            return message
    return None


def _not_yet_valid(exc: BaseException) -> bool:
    """Whether ``exc`` is the node's answer that the authorization is not valid yet (the token's revert)."""
    message = str(getattr(exc, "message", None) or exc).lower()
    return isinstance(exc, ContractLogicError | Web3RPCError | ValueError) and NOT_YET_VALID in message


def relay_cost(fee_fields: dict[str, int]) -> int:
    """The most one relay transaction can cost its sender (wei): GAS_LIMIT at the fee cap."""
    return GAS_LIMIT * int(fee_fields.get("maxFeePerGas") or 0)


def short_of_funds(chain: EvmChain, sender: str, fee_fields: dict[str, int]) -> bool:
    return int(chain.w3.eth.get_balance(to_checksum_address(sender))) < relay_cost(fee_fields)


@contextlib.contextmanager
def lease(
    redis: Redis,
    network: str,
    accounts: list[LocalAccount],
    wait_seconds: float = 20,
    skip: frozenset[str] = frozenset(),
) -> Iterator[LocalAccount]:
    """Hold one free relay account of the network (not one of ``skip``) for the duration of a send."""
    token = secrets.token_hex(8)
    deadline = time.monotonic() + wait_seconds
    accounts = [account for account in accounts if account.address not in skip]
    if not accounts:
        raise RelayUnavailable(f"no relay account of {network} to lease")
    start = secrets.randbelow(len(accounts))
    while True:
        for i in range(len(accounts)):
            account = accounts[(start + i) % len(accounts)]
            key = LEASE_KEY.format(network, account.address)
            if redis.set(key, token, nx=True, ex=LEASE_SECONDS):
                try:
                    yield account
                finally:
                    if redis.get(key) == token.encode():
                        redis.delete(key)
                return
        if time.monotonic() > deadline:
            raise RelayUnavailable(f"no relay account of {network} became free within {wait_seconds:.0f}s")
        time.sleep(0.02)


def _next_nonce(redis: Redis, chain: EvmChain, account: LocalAccount) -> int:
    """The chain's pending count, unless our last transaction is still known to the node but not yet
    counted (a lagging or load-balanced RPC). A dropped transaction leaves no gap: the chain wins."""
    pending = int(chain.w3.eth.get_transaction_count(account.address, "pending"))
    last = redis.get(NONCE_KEY.format(chain.network.network, account.address))
    if last:
        last_nonce, _, last_hash = (last.decode() if isinstance(last, bytes) else str(last)).partition(":")
        if int(last_nonce) >= pending and is_pending(chain, last_hash):
            return int(last_nonce) + 1
    return pending


def is_pending(chain: EvmChain, tx_hash: str) -> bool:
    """Whether the node still holds the transaction unmined (so it may yet be mined)."""
    from web3.exceptions import TransactionNotFound

    try:
        tx = chain.w3.eth.get_transaction(HexStr(tx_hash))
    except TransactionNotFound:
        return False
    return tx.get("blockNumber") is None


FEE_CACHE_SECONDS = 3.0
_fee_cache: dict[str, tuple[float, dict[str, int]]] = {}


def fees(chain: EvmChain) -> dict[str, int]:
    """EIP-1559: tip as the node suggests, cap at twice the base fee plus the tip (cached 3 s per
    chain: the cap leaves room for the base fee to rise for several blocks)."""
    network = chain.network.network
    cached = _fee_cache.get(network)
    if cached is not None and time.monotonic() - cached[0] < FEE_CACHE_SECONDS:
        return cached[1]
    base_fee = int(chain.w3.eth.get_block("latest").get("baseFeePerGas") or 0)
    try:
        tip = int(chain.w3.eth.max_priority_fee)
    except Exception:
        tip = PRIORITY_FEE_WEI
    fees = {"maxPriorityFeePerGas": tip, "maxFeePerGas": 2 * base_fee + tip}
    _fee_cache[network] = (time.monotonic(), fees)
    return fees


def transfer_call(chain: EvmChain, settlement: Settlement) -> Any:
    terms = settlement_terms(settlement)
    assert isinstance(terms, EvmTerms)
    signature = bytes.fromhex(terms.signature_hex[2:])
    r, s, v = signature[:32], signature[32:64], signature[64]
    return chain.token.functions.transferWithAuthorization(
        terms.payer,
        terms.pay_to,
        terms.value,
        terms.valid_after,
        terms.valid_before,
        terms.nonce,
        v if v >= 27 else v + 27,
        r,
        s,
    )


def estimate(chain: EvmChain, call: Any, sender: str, fee_fields: dict[str, int]) -> int:
    """The gas the transfer needs, estimated as it will be sent: from the account that sends it, with the same
    fee fields (a payer's code may read the gas price: at 0, what ``eth_estimateGas`` uses without them, it
    may answer otherwise) and at most ``GAS_LIMIT`` (more is a refusal, not a bigger transaction).

    Raises ``Reverted`` when the transfer cannot succeed; ``RelayShortOfFunds`` when ``sender`` cannot pay
    ``GAS_LIMIT`` at the fee cap (checked before, and again when the node says the gas "exceeds allowance":
    the node caps the allowance by the sender's balance, so only a funded sender's answer means "more than
    the cap"); ``NotYetValid`` when the token says validAfter has not passed on chain yet."""
    if short_of_funds(chain, sender, fee_fields):
        raise RelayShortOfFunds(f"relay account {sender} cannot pay {GAS_LIMIT} gas at the fee cap")
    try:
        return int(call.estimate_gas({"from": sender, "gas": GAS_LIMIT, **fee_fields}))
    except Exception as exc:
        if _not_yet_valid(exc):
            raise NotYetValid(str(getattr(exc, "message", None) or exc)) from None
        reason = final_refusal(exc)
        if reason is None:
            raise
        if any(part in reason.lower() for part in _GAS_ALLOWANCE) and short_of_funds(chain, sender, fee_fields):
            raise RelayShortOfFunds(f"relay account {sender} cannot pay {GAS_LIMIT} gas at the fee cap") from None
        raise Reverted(reason) from None


def send(
    redis: Redis,
    chain: EvmChain,
    accounts: list[LocalAccount],
    call: Any,
    fee_fields: dict[str, int],
    before_broadcast: Any,
) -> str:
    """Estimate from a leased account, then sign and broadcast from it; ``before_broadcast(tx_hash, address)``
    runs first.

    The transaction has ``GAS_LIMIT`` gas and the fees it was estimated with. A relay account that cannot pay
    that (``RelayShortOfFunds``, or the node's "insufficient funds") is left aside and another one is leased;
    when none can, ``RelayShortOfFunds`` (transient: the settlement stays open). Raises ``Reverted`` when the
    estimate says the transfer cannot succeed, ``Refused`` when the node refuses it for good
    (``final_refusal``), ``NotYetValid`` (transient)."""
    network = chain.network.network
    short: set[str] = set()
    attempt = 0
    while attempt < MAX_SEND_ATTEMPTS:
        if len(short) >= len({account.address for account in accounts}):
            raise RelayShortOfFunds(f"every relay account of {network} is short of ETH: fund them")
        with lease(redis, network, accounts, skip=frozenset(short)) as account:
            try:
                estimate(chain, call, account.address, fee_fields)
            except RelayShortOfFunds:
                log.error("relay account %s of %s is short of ETH: fund it (another account is used)",
                          account.address, network)  # fmt: skip
                short.add(account.address)
                continue
            nonce = _next_nonce(redis, chain, account)
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
            before_broadcast(tx_hash, account.address)
            try:
                chain.w3.eth.send_raw_transaction(signed.raw_transaction)
            except Exception as exc:
                message = str(exc).lower()
                if "already known" not in message:  # else: the very same transaction is in the pool
                    reason = final_refusal(exc)
                    if reason is not None:
                        raise Refused(reason) from None
                    if "insufficient funds" in message:  # its balance fell since the estimate: another account
                        short.add(account.address)
                        continue
                    attempt += 1
                    retryable = "nonce too low" in message or "replacement transaction underpriced" in message
                    if not retryable or attempt >= MAX_SEND_ATTEMPTS:
                        raise
                    redis.delete(NONCE_KEY.format(network, account.address))
                    time.sleep(0.2 * attempt)
                    continue
            redis.set(NONCE_KEY.format(network, account.address), f"{nonce}:{tx_hash}")
            return tx_hash
    raise RelayUnavailable("could not send the transaction")


def wait_confirmations(chain: EvmChain, block_number: int, timeout: float) -> bool:
    """Wait until the block is buried under the network's confirmations (1 = mined)."""
    deadline = time.monotonic() + timeout
    while not chain.is_final(block_number):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def wait_receipt(chain: EvmChain, tx_hash: str, timeout: float) -> dict[str, Any] | None:
    from web3.exceptions import TimeExhausted

    try:
        return dict(chain.w3.eth.wait_for_transaction_receipt(HexStr(tx_hash), timeout=timeout, poll_latency=0.05))
    except TimeExhausted:
        return None
