"""The EVM rail's submit: ``transferWithAuthorization`` from relay accounts (leases, nonces, fees), and the relay keys.

Several relay accounts per chain are used in parallel: a job leases a free account (a Redis lock),
takes its next nonce, signs and broadcasts, then releases the lease before waiting for the
receipt. The next nonce lives in Redis and is reconciled with the chain's pending count on every
lease, so it survives restarts and transactions sent by anyone else.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_utils import to_checksum_address
from redis import Redis
from web3.exceptions import ContractLogicError, Web3RPCError

from backend.chains.evm import EvmChain, evm_chain
from backend.chains.registry import Network
from backend.rails.base import (
    BeforeBroadcast,
    CannotSucceed,
    Claim,
    LeftOpen,
    RelayKeyError,
    Submission,
    Terms,
)
from backend.rails.evm.terms import EvmTerms
from backend.rails.evm.watch import is_pending

# Gas one transferWithAuthorization may use: 60,000-90,000 for USDC's FiatToken and our TestUSDC (a
# first payment to an address, a fresh nonce); the bound leaves room for the rest. It is also the gas
# limit of every relay transaction (GAS_LIMIT), so no settlement's execution gas exceeds it.
EVM_SETTLEMENT_GAS = 120_000

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


# How nodes say a broadcast's bytes are the very transaction they already hold (the send is then as good as taken):
# geth and its forks "already known", Anvil "transaction already imported", Besu "Known transaction", Nethermind
# "AlreadyKnown". Matched on the lower-cased message; "known transaction" only at a word's start ("unknown
# transaction" is no such answer).
ALREADY_HELD = re.compile(r"already known|already imported|\bknown transaction|alreadyknown")


def already_known(exc: BaseException) -> bool:
    """Whether a broadcast's error says the node already holds this very transaction (in its pool): not a refusal.
    Anvil words it "transaction already imported", geth "already known"; treating either as a refusal would take
    the nonce back and cancel a payment in flight."""
    return ALREADY_HELD.search(str(exc).lower()) is not None


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


def transfer_call(chain: EvmChain, terms: Terms) -> Any:
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


def sign_transfer(chain: EvmChain, call: Any, account: LocalAccount, nonce: int, fee_fields: dict[str, int]) -> Any:
    """``call`` (``transfer_call``) signed by ``account`` at ``nonce`` with ``GAS_LIMIT`` gas and ``fee_fields``:
    the pipelined submit's transaction and the fee bump's replacement of it."""
    tx = call.build_transaction(
        {"from": account.address, "nonce": nonce, "gas": GAS_LIMIT, "chainId": chain.network.chain_id, **fee_fields}
    )
    return account.sign_transaction(tx)


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
    before_broadcast: Callable[[str, str, int], None],
) -> str:
    """Estimate from a leased account, then sign and broadcast from it; ``before_broadcast(tx_hash, address,
    nonce)`` runs first.

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
            before_broadcast(tx_hash, account.address, nonce)
            try:
                chain.w3.eth.send_raw_transaction(signed.raw_transaction)
            except Exception as exc:
                message = str(exc).lower()
                if not already_known(exc):  # else: the very same transaction is in the pool
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


# failure_code of a settlement whose payer has code when the relayer is about to send (docs/security.md).
PAYER_HAS_CODE = "PAYER_HAS_CODE"
PAYER_CODE_REASON = (
    "the payer's address has contract code (a smart wallet or an EIP-7702 delegation): the relay does not "
    "settle such authorizations; pay from a plain address"
)
# An authorization whose validAfter the chain's latest block has not passed yet (the token needs
# block.timestamp > validAfter) is waited for this long, then left open for the reconciler to send again.
NOT_YET_VALID_WAIT_SECONDS = 10.0


def valid_on_chain(chain: EvmChain, valid_after: int) -> bool:
    """Whether the chain's latest block is past validAfter (then every later block is too), waiting for it up
    to NOT_YET_VALID_WAIT_SECONDS."""
    deadline = time.monotonic() + NOT_YET_VALID_WAIT_SECONDS
    while chain.block_timestamp("latest") <= valid_after:
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return True


def submit(
    network: Network, claim: Claim, accounts: list[LocalAccount], leases: Redis, before_broadcast: BeforeBroadcast
) -> Submission:
    """The last checks, then the transfer from a leased relay account (``send``); raises a ``SubmitError``."""
    chain = evm_chain(network)
    terms = claim.terms
    assert isinstance(terms, EvmTerms)
    # /pay refused a payer with code, but code can appear since (an EIP-7702 delegation): look again, now,
    # right before the estimate and the send (the code's answer at estimate time proves nothing).
    if chain.has_code(terms.payer):
        raise CannotSucceed(PAYER_CODE_REASON, PAYER_HAS_CODE)
    # Not before the chain's clock passes validAfter: the transaction would revert (docs/security.md).
    if not valid_on_chain(chain, terms.valid_after):
        raise LeftOpen("validAfter has not passed on chain yet", "not-yet-valid")  # the reconciler sends it again
    call = transfer_call(chain, terms)
    fee_fields = fees(chain)  # the estimate and the send use the same fee fields
    sent: list[str] = []

    def recorded(tx_hash: str, address: str, nonce: int) -> None:
        before_broadcast(tx_hash, address, nonce)
        sent.append(address)

    try:
        # Estimated from the leased account that then sends it, with its fees (send).
        tx_hash = send(leases, chain, accounts, call, fee_fields, before_broadcast=recorded)
    except Refused as exc:
        # The node refused it for good: final, not retried (the chain still decides first).
        raise CannotSucceed(f"the node refused it: {exc}") from None
    except Reverted as exc:  # the estimate, from the account that would send it
        raise CannotSucceed(f"the transfer would revert: {exc}") from None
    except NotYetValid:
        # The node's clock disagrees with its latest block's: transient, left open.
        raise LeftOpen("validAfter has not passed on chain yet", "not-yet-valid") from None
    except RelayShortOfFunds as exc:
        # Our relay's trouble, never the payment's: left open (the reconciler sends it again) and said loudly.
        raise LeftOpen(f"waits: {exc}", "relay-short-of-eth", loud=True) from None
    return Submission(tx_hash, sent[-1])


class EvmRelayKeys:
    """A network's relay accounts (the relayer process leases its share: rails/evm/accounts.py)."""

    def __init__(self, accounts: list[LocalAccount]) -> None:
        self.accounts = accounts
        # (network, address) -> the highest relay_nonce a settlement recorded: set by the relayer's main
        # (``use_recorded_nonces``), which may read the database; the rail does not.
        self.recorded_nonce: Callable[[str, str], int | None] | None = None

    def use_recorded_nonces(self, recorded_nonce: Callable[[str, str], int | None]) -> None:
        self.recorded_nonce = recorded_nonce

    def addresses(self) -> tuple[str, ...]:
        return tuple(account.address for account in self.accounts)

    def secrets(self) -> tuple[str, ...]:
        return tuple(account.key.hex() for account in self.accounts)

    def summary(self, network_id: str) -> str:
        return f"{len(self.accounts)} relay account(s) on {network_id}: {', '.join(self.addresses())}"


def load_keys(network: Network, secrets: Sequence[str]) -> EvmRelayKeys | None:
    """Hex private keys; they must be the chains file's relay_addresses (when it lists them)."""
    try:
        loaded = [Account.from_key(k) for k in secrets]
    except Exception:
        raise RelayKeyError(f"a relay key for {network.network} is not a valid private key") from None
    expected = set(network.relay_addresses)
    if expected and {a.address for a in loaded} != expected:
        raise RelayKeyError(f"the relay keys for {network.network} do not match relay_addresses in the chains file")
    return EvmRelayKeys(loaded) if loaded else None


def check_chain_id(network: Network) -> None:
    """Refuse to sign for a network whose RPC answers with another chain id (a misconfigured URL)."""
    try:
        answered = evm_chain(network).w3.eth.chain_id
    except Exception as exc:
        log.warning("relayer: %s unreachable at start-up (%s); will retry per job", network.network, type(exc).__name__)
        return
    if answered != network.chain_id:
        raise RelayKeyError(f"the RPC of {network.network} answers chain id {answered}, not {network.chain_id}")
