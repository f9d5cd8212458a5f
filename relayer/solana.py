"""Solana settlement in the relayer: co-sign the checked buyer transaction as fee payer, send, confirm.

The relay pays the transaction fee and nothing else (no account rent: a payment that must open the
merchant's USDC account opens it in the buyer's transaction, funded by the buyer, and not again on a
chain where payments already landed in it: ``backend.settlement.solana``).

The relay's ed25519 signature over the same message is always the same, so the transaction id
is known before sending: it is recorded first (``mark_submitted``), then the transaction is sent.
Sending it again is harmless (the network processes a signature once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from solders.keypair import Keypair
from solders.pubkey import Pubkey

from backend.chains.registry import Network
from backend.chains.solana import SolanaChain, SolanaRpcError
from backend.rails.solana.rail import SolanaTerms
from backend.settlement import models as st
from backend.settlement import services
from backend.settlement.solana import finish_from_chain, payee_account_closed
from payintent import solana_tx as stx

log = logging.getLogger(__name__)

CONFIRM_TIMEOUT_SECONDS = 60.0
_POLL_SECONDS = 0.2


def associated_account(owner: str, mint: str) -> Pubkey:
    return stx.associated_token_address(Pubkey.from_string(owner), Pubkey.from_string(mint))


def _wait(chain: SolanaChain, signature: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = chain.signature_status(signature)
        if status is not None and (
            status.get("err") is not None or status.get("confirmationStatus") in ("confirmed", "finalized")
        ):
            return True
        time.sleep(_POLL_SECONDS)
    return False


def settle(
    chain: SolanaChain,
    network: Network,
    relay: Keypair,
    settlement: st.Settlement,
    crash_point: Callable[[str], None],
) -> str:
    if settlement.status == st.SUBMITTED and finish_from_chain(chain, settlement):
        return "finished-from-chain"
    terms = st.settlement_terms(settlement)
    assert isinstance(terms, SolanaTerms)
    if chain.block_height() > terms.last_valid_block_height:
        finish_from_chain(chain, settlement)
        return "expired"
    tx = stx.decode(terms.transaction)
    # The relay signs only what the rules allow, whatever the database holds.
    expected = {
        "asset": network.usdc_address,
        "payTo": settlement.pay_to,
        "maxAmountRequired": settlement.amount_atomic,
    }
    try:
        payment = stx.check_payment(tx, expected, settlement.intent_id, str(relay.pubkey()))
    except stx.SolanaTransactionError as exc:
        log.error("settlement %s: refusing to co-sign (%s)", settlement.id, exc)
        services.fail_settlement(settlement.id, exc.code, f"the relay refused the transaction: {exc}")
        return "refused-by-relay"
    missing = chain.token_balance(str(associated_account(settlement.pay_to, network.usdc_address))) is None
    # Closed since /pay checked it. Sent now, a transaction that does not open it would fail and still cost the
    # relay its fee; one that opens it would make this buyer pay the rent the merchant already took back once
    # (payments landed in it on this chain): neither is sent.
    closed = missing and payee_account_closed(chain, network.network, settlement.pay_to, network.usdc_address)
    if missing and (closed or not payment.creates_payee_account):
        if settlement.status == st.PENDING and not settlement.tx_hash:  # never signed by the relay: cannot land
            code = "PAYEE_ACCOUNT_CLOSED" if closed else "PAYEE_ACCOUNT_MISSING"
            services.fail_settlement(settlement.id, code, "the merchant's USDC account was closed before settlement")
        return "payee-account-missing"  # else an earlier send may still land: the reconciler decides
    tx = stx.sign_as(tx, relay)
    signature = str(tx.signatures[0])
    if settlement.tx_hash != signature:
        services.mark_submitted(settlement.id, signature, str(relay.pubkey()))
        crash_point("after-mark-submitted")
    try:
        chain.send(stx.encode(tx))
    except SolanaRpcError as exc:
        # Refused in preflight (or already processed). The intent is not released here: the
        # reconciler decides once the signature is known or the blockhash has expired.
        log.warning("settlement %s: the node refused the transaction (%s)", settlement.id, exc)
        if finish_from_chain(chain, services.get_settlement(settlement.id) or settlement):
            return "finished-from-chain"
        return "refused"
    crash_point("after-broadcast")
    _wait(chain, signature, CONFIRM_TIMEOUT_SECONDS)
    crash_point("before-finish")
    if finish_from_chain(chain, services.get_settlement(settlement.id) or settlement):
        return "finished"
    return "waiting-for-confirmation"  # the reconciler finishes it
