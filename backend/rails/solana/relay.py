"""The Solana rail's submit: co-sign the checked buyer transaction as fee payer, send; its watch and relay key.

The relay pays the transaction fee and nothing else (no account rent: a payment that must open the
merchant's USDC account opens it in the buyer's transaction, funded by the buyer, and not again on a
chain where payments already landed in it: ``backend.settlement.solana``).

The relay's ed25519 signature over the same message is always the same, so the transaction id
is known before sending: it is recorded first (``before_broadcast``: ``mark_submitted``), then the
transaction is sent. Sending it again is harmless (the network processes a signature once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from solders.keypair import Keypair
from solders.pubkey import Pubkey

from backend.chains.registry import Network
from backend.chains.solana import SolanaChain, SolanaRpcError, solana_chain
from backend.rails.base import (
    BeforeBroadcast,
    ChainDecides,
    Claim,
    LeftOpen,
    PayeeLedger,
    RelayKeyError,
    RelayRefuses,
    Submission,
    Terms,
    TxState,
    TxStatus,
)
from backend.rails.solana.poller import LANDED, is_catchable, poller_for
from backend.rails.solana.terms import SolanaTerms
from payintent import solana_tx as stx

log = logging.getLogger(__name__)

CONFIRM_TIMEOUT_SECONDS = 60.0


def associated_account(owner: str, mint: str) -> Pubkey:
    return stx.associated_token_address(Pubkey.from_string(owner), Pubkey.from_string(mint))


def payee_account_closed(chain: SolanaChain, ledger: PayeeLedger, network_id: str, owner: str, mint: str) -> bool:
    """Whether a payment of ours landed in ``owner``'s account of ``mint`` on this chain (same genesis hash): if
    the account is missing now, its owner closed it. Raises SolanaRpcError if the genesis hash cannot be read."""
    return ledger.landed_before(network_id, owner, mint, chain.genesis_hash())


def submit(
    network: Network,
    claim: Claim,
    relay: Keypair,
    ledger: PayeeLedger,
    may_still_execute: Callable[[Terms, int], bool],
    before_broadcast: BeforeBroadcast,
) -> Submission:
    """Check, co-sign and send; raises a ``SubmitError``. ``may_still_execute``: the rail's comparison of
    ``last_valid_block_height`` with a height (the last-moment check of the blockhash before signing)."""
    chain = solana_chain(network)
    terms = claim.terms
    assert isinstance(terms, SolanaTerms)
    if not may_still_execute(terms, chain.block_height()):
        raise ChainDecides("expired", "expired")  # the chain decides (its blockhash has expired): never sent now
    tx = stx.decode(terms.transaction)
    # The relay signs only what the rules allow, whatever the database holds.
    expected = {"asset": network.usdc_address, "payTo": terms.pay_to, "maxAmountRequired": terms.value}
    try:
        payment = stx.check_payment(tx, expected, claim.intent_id, str(relay.pubkey()))
    except stx.SolanaTransactionError as exc:
        raise RelayRefuses(exc.code, f"the relay refused the transaction: {exc}", "refused-by-relay",
                           logged=f"refusing to co-sign ({exc})") from None  # fmt: skip
    missing = chain.token_balance(str(associated_account(terms.pay_to, network.usdc_address))) is None
    # Closed since /pay checked it. Sent now, a transaction that does not open it would fail and still cost the
    # relay its fee; one that opens it would make this buyer pay the rent the merchant already took back once
    # (payments landed in it on this chain): neither is sent.
    closed = missing and payee_account_closed(chain, ledger, network.network, terms.pay_to, network.usdc_address)
    if missing and (closed or not payment.creates_payee_account):
        if not claim.tx_id:  # never signed by the relay: cannot land
            code = "PAYEE_ACCOUNT_CLOSED" if closed else "PAYEE_ACCOUNT_MISSING"
            reason = "the merchant's USDC account was closed before settlement"
            raise RelayRefuses(code, reason, "payee-account-missing")
        raise LeftOpen("the payee account is missing", "payee-account-missing")  # an earlier send may still land
    tx = stx.sign_as(tx, relay)
    signature = str(tx.signatures[0])
    if claim.tx_id != signature:
        before_broadcast(signature, str(relay.pubkey()), None)
    encoded = stx.encode(tx)
    # The network's poller sends it again while it is in flight and may still execute (``wait_landed``).
    poller = poller_for(chain.rpc_url)
    try:
        chain.send(encoded)
    except SolanaRpcError as exc:
        if exc.unreachable:  # a timeout: the node may have it; sent again (one signature: executed at most once)
            poller.track(signature, encoded, lambda height: may_still_execute(terms, height))
        # Refused in preflight (or already processed). The intent is not released here: the
        # reconciler decides once the signature is known or the blockhash has expired.
        raise ChainDecides("refused", logged=f"the node refused the transaction ({exc})") from None
    poller.track(signature, encoded, lambda height: may_still_execute(terms, height))
    return Submission(signature, str(relay.pubkey()))


def fee(claim: Claim) -> int:
    """The fee the relay pays for the claim's transaction once it lands (successful or not): exact, from the
    signed message."""
    assert isinstance(claim.terms, SolanaTerms)
    return stx.transaction_fee(stx.decode(claim.terms.transaction).message)


def status_of(status: dict[str, Any] | None, claim: Claim) -> TxStatus:
    """A signature's status: landed (successful or failed) once confirmed; a failure seen only at ``processed``
    decides nothing."""
    if status is None:
        return TxStatus(TxState.UNKNOWN)
    if status.get("confirmationStatus") not in LANDED:
        return TxStatus(TxState.PENDING)
    state = TxState.FAILED if status.get("err") is not None else TxState.SUCCEEDED
    return TxStatus(state, status.get("slot"), True, fee(claim))


def watch(chain: SolanaChain, claims: Sequence[Claim]) -> dict[str, TxStatus]:
    """Every claim's status from one ``getSignatureStatuses`` (one per 256 claims)."""
    sent = [claim for claim in claims if claim.tx_id]
    statuses = chain.signature_statuses([claim.tx_id for claim in sent if claim.tx_id])
    return {claim.tx_id: status_of(status, claim) for claim, status in zip(sent, statuses, strict=True) if claim.tx_id}


def wait_landed(
    chain: SolanaChain, claim: Claim, timeout: float, may_still_execute: Callable[[Terms, int], bool]
) -> TxStatus | None:
    """Wait for the claim's signature to land (confirmed) on the network's shared poller (``poller``); None if it
    did not within ``timeout``, or can never land (no status and its blockhash expired: ``may_still_execute``)."""
    if not claim.tx_id:
        return None
    terms = claim.terms
    status = poller_for(chain.rpc_url).wait(claim.tx_id, lambda height: may_still_execute(terms, height), timeout)
    return None if status is None else status_of(status, claim)


class SolanaRelayKeys:
    """A network's fee payer."""

    def __init__(self, keypair: Keypair) -> None:
        self.keypair = keypair

    def addresses(self) -> tuple[str, ...]:
        return (str(self.keypair.pubkey()),)

    def secrets(self) -> tuple[str, ...]:
        return (str(self.keypair),)  # its base58 secret

    def summary(self, network_id: str) -> str:
        return f"fee payer {self.keypair.pubkey()} on {network_id}"

    def use_recorded_nonces(self, recorded_nonce: Callable[[str, str], int | None]) -> None:
        """Solana has no relay nonces: unused."""


def load_keys(network: Network, secrets: Sequence[str]) -> SolanaRelayKeys | None:
    """The fee-payer keypair (a base58 64-byte secret key); must match fee_payer."""
    if not secrets:
        return None
    try:
        keypair = Keypair.from_base58_string(secrets[0])
    except BaseException as exc:  # solders may panic on malformed input
        if not is_catchable(exc):
            raise
        raise RelayKeyError(f"the relay key for {network.network} is not a base58 Solana keypair") from None
    if network.fee_payer and str(keypair.pubkey()) != network.fee_payer:
        raise RelayKeyError(f"the relay key for {network.network} does not match fee_payer in the chains file")
    return SolanaRelayKeys(keypair)
