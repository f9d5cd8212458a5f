"""Solana payments on the API side: the unsigned transaction, and the checks before the relay co-signs.

The API holds no key. It builds the transaction the buyer signs (``prepare_transaction``) and,
at ``/pay``, checks the buyer-signed one instruction by instruction (``payintent.solana_tx``)
and simulates it without signature verification (the relay has not signed yet).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from solders.pubkey import Pubkey

from backend import clock
from backend.chains.registry import ChainRegistry, Network
from backend.chains.solana import SolanaChain, SolanaRpcError
from backend.errors import APIError
from backend.intents.models import Intent
from backend.merchants.addresses import AddressError, normalize_solana_address
from backend.money import from_atomic
from backend.settlement import services
from payintent import solana_tx as stx

log = logging.getLogger(__name__)

_chains: dict[str, SolanaChain] = {}


def solana_chain(network: Network) -> SolanaChain:
    if not network.rpc_url:
        raise APIError(503, "CHAIN_UNAVAILABLE", f"{network.name} has no RPC URL configured")
    chain = _chains.get(network.rpc_url)
    if chain is None:
        chain = _chains[network.rpc_url] = SolanaChain(network.rpc_url)
    return chain


def _unavailable(network: Network, exc: Exception) -> APIError:
    log.warning("Solana RPC for %s failed: %s", network.network, type(exc).__name__)
    return APIError(503, "CHAIN_UNAVAILABLE", f"{network.name} cannot be reached right now; try again")


def solana_requirement(
    intent: Intent, registry: ChainRegistry, network_id: str | None
) -> tuple[dict[str, Any], Network]:
    """The intent's Solana requirement (the named one, or its only Solana one) and its network."""
    for requirement in intent.payment_requirements or []:
        network = registry.get(requirement["network"])
        if network is None or network.kind != "solana":
            continue
        if network_id is None or network_id == network.network:
            return requirement, network
    raise APIError(400, "UNSUPPORTED_NETWORK", "This intent has no Solana payment requirement for that network")


def _relay(network: Network) -> str:
    if not network.fee_payer:
        raise APIError(503, "CHAIN_UNAVAILABLE", f"No relay (fee payer) is configured for {network.name}")
    return network.fee_payer


def prepare_transaction(
    intent: Intent,
    registry: ChainRegistry,
    payer: str,
    network_id: str | None,
    redis: Any = None,
    queue_name: str = "relayer",
) -> dict[str, Any]:
    """The base64 transaction the buyer signs: fresh blockhash, relay as fee payer, exact amount, memo."""
    services.check_payable(intent, clock.now())
    requirement, network = solana_requirement(intent, registry, network_id)
    try:
        payer = normalize_solana_address(payer)
    except AddressError as exc:
        raise APIError(400, "VALIDATION_ERROR", f"payer: {exc}", fields={"payer": [str(exc)]}) from None
    fee_payer = _relay(network)
    if payer == requirement["payTo"]:
        raise APIError(400, "PAYER_IS_RECIPIENT", "The payer is the merchant's own wallet")
    if payer == fee_payer:
        raise APIError(400, "VALIDATION_ERROR", "payer: the relay cannot pay", fields={"payer": ["is the relay"]})
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
        raise APIError(
            402,
            "SETTLEMENT_FAILED",
            "The buyer's USDC balance is too low for this payment",
            reason=f"insufficient balance: {from_atomic(balance or 0)} USDC available, {from_atomic(amount)} required",
        )
    try:
        if not payee_account_ready(chain, requirement):  # created by the relayer while the buyer signs
            _refuse_if_closed(network, requirement["payTo"])
            request_payee_account(redis, queue_name, network, requirement["payTo"], 0)
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
    )
    return {
        "transaction": stx.encode(tx),
        "network": network.network,
        "payer": payer,
        "fee_payer": fee_payer,
        "recent_blockhash": blockhash.blockhash,
        "last_valid_block_height": blockhash.last_valid_block_height,
    }


# A blockhash is usable for about 150 blocks; 300 (the size of the node's blockhash queue) leaves
# room for RPC lag and off-by-one at the edges before the reconciler may call a transaction dead.
BLOCKHASH_MARGIN = 300
PAYEE_ACCOUNT_JOB = "relayer.tasks.create_token_account"
PAYEE_READY_KEY = "payintent:token-account:{}:{}"


def payee_account_ready(chain: SolanaChain, requirement: dict[str, Any]) -> bool:
    account = stx.associated_token_address(
        Pubkey.from_string(requirement["payTo"]), Pubkey.from_string(requirement["asset"])
    )
    return chain.account_exists(str(account))


def token_account_created_before(network_id: str, owner: str) -> bool:
    """Whether the relay already created this wallet's USDC account once (it never pays twice)."""
    from sqlalchemy import select

    from backend.extensions import db
    from backend.merchants.models import Wallet

    found = db.session.scalar(
        select(Wallet.id)
        .where(Wallet.network == network_id, Wallet.address == owner, Wallet.token_account_created_at.is_not(None))
        .limit(1)
    )
    return found is not None


def _refuse_if_closed(network: Network, owner: str) -> None:
    if token_account_created_before(network.network, owner):
        raise APIError(
            409,
            "PAYEE_ACCOUNT_MISSING",
            "The merchant's USDC account was created once and has since been closed; the merchant must re-create it",
        )


def request_payee_account(redis: Any, queue_name: str, network: Network, owner: str, wait_seconds: float) -> None:
    """Ask the relayer to create ``owner``'s USDC account (it pays the rent); wait up to ``wait_seconds``.

    The API holds no key, so the relayer does it, never inside a buyer's transaction.
    """
    from rq import Queue
    from rq.exceptions import DuplicateJobError

    from backend.queueing import relayer_queue

    if redis is None:
        return
    key = PAYEE_READY_KEY.format(network.network, owner)
    with contextlib.suppress(DuplicateJobError):  # already asked: wait for that one
        Queue(relayer_queue(queue_name, network.network), connection=redis).enqueue(
            PAYEE_ACCOUNT_JOB,
            network.network,
            owner,
            job_id=f"token-account-{network.network}-{owner}".replace(":", "-"),
            unique=True,
            result_ttl=60,
            failure_ttl=300,
            job_timeout=120,
        )
    if wait_seconds > 0:
        redis.blpop([key], timeout=wait_seconds)


@dataclass(frozen=True)
class SolanaAuthorization:
    """A checked buyer-signed transaction, in the settlement row's terms."""

    payer: str
    pay_to: str
    value: int
    valid_after: int
    valid_before: int  # a block height past which its blockhash surely expired (generous upper bound)
    nonce_hex: str  # sha256 of the signed message: one settlement per transaction
    signature_hex: str  # the buyer-signed transaction, base64


def check_signed_transaction(
    intent: Intent,
    requirement: dict[str, Any],
    network: Network,
    payload: dict[str, Any],
    redis: Any = None,
    queue_name: str = "relayer",
) -> SolanaAuthorization:
    """Every rule of payintent.solana_tx, then a simulation (no signature check: the relay signs later).

    The merchant's USDC account must exist for the simulation: if it does not yet, the relayer is
    asked to create it first (waiting up to 15 s).
    """
    fee_payer = _relay(network)
    try:
        tx = stx.decode(payload.get("transaction"))
        payment = stx.check_payment(tx, requirement, intent.id, fee_payer)
    except stx.SolanaTransactionError as exc:
        raise APIError(400, exc.code, str(exc)) from None
    chain = solana_chain(network)
    try:
        if not payee_account_ready(chain, requirement):
            _refuse_if_closed(network, requirement["payTo"])
            request_payee_account(redis, queue_name, network, requirement["payTo"], 15.0)
            if not payee_account_ready(chain, requirement):
                raise APIError(
                    503, "PAYEE_ACCOUNT_PENDING", "The merchant's USDC account is being created; try again shortly"
                )
        simulation = chain.simulate(stx.encode(tx), sig_verify=False)
        height = chain.block_height("processed")  # after the simulation: a blockhash it accepted is older
    except SolanaRpcError as exc:
        raise _unavailable(network, exc) from None
    if simulation.err is not None:
        text = str(simulation.err)
        if "BlockhashNotFound" in text:
            raise APIError(400, "BLOCKHASH_EXPIRED", "The transaction's blockhash expired; fetch a new transaction")
        if "AlreadyProcessed" in text:
            raise APIError(409, "NONCE_ALREADY_USED", "This transaction was already processed")
        detail = next((line for line in reversed(simulation.logs) if "Error" in line or "failed" in line), text)
        raise APIError(402, "SETTLEMENT_FAILED", "The payment would fail on chain", reason=f"simulation: {detail}")
    return SolanaAuthorization(
        payer=payment.payer,
        pay_to=requirement["payTo"],
        value=payment.amount_atomic,
        valid_after=0,
        valid_before=height + BLOCKHASH_MARGIN,
        nonce_hex="0x" + payment.message_hash,
        signature_hex=stx.encode(tx),
    )


def finish_from_chain(chain: SolanaChain, settlement: Any) -> bool:
    """Finish a Solana settlement if the chain has decided it; returns whether it is finished.

    The relay's signature (the transaction id) is recorded before sending, so a crash after the
    send still leaves the signature to look up. Executed (confirmed) → paid; failed (at confirmed
    or finalized commitment) → failed. The intent is released unexecuted only when the finalized
    height is past ``valid_before`` and the node no longer accepts the blockhash: then the
    transaction can never land. The height is read before the status, so a transaction landing
    in between is seen.
    """
    from backend.settlement import services

    height = chain.block_height("finalized")
    if settlement.tx_hash:
        status = chain.signature_status(settlement.tx_hash)
        if status is not None and status.get("confirmationStatus") in ("confirmed", "finalized"):
            if status.get("err") is not None:
                services.fail_settlement(settlement.id, "SETTLEMENT_FAILED", f"transaction failed: {status['err']}")
            else:
                services.complete_settlement(settlement.id, settlement.tx_hash)
            return True
        if status is not None:
            return False  # seen but not yet confirmed
    if height <= settlement.valid_before:
        return False
    blockhash = str(stx.decode(settlement.signature).message.recent_blockhash)
    if chain.is_blockhash_valid(blockhash):
        return False
    services.fail_settlement(
        settlement.id, "AUTHORIZATION_EXPIRED", "the transaction's blockhash expired before it executed"
    )
    return True
