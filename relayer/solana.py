"""Solana settlement in the relayer: co-sign the checked buyer transaction as fee payer, send, confirm.

The relay's ed25519 signature over the same message is always the same, so the transaction id
is known before sending: it is recorded first (``mark_submitted``), then the transaction is sent.
Sending it again is harmless (the network processes a signature once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from solders.hash import Hash
from solders.keypair import Keypair
from solders.message import MessageV0
from solders.pubkey import Pubkey
from solders.transaction import VersionedTransaction

from backend.chains.registry import Network
from backend.chains.solana import SolanaChain, SolanaRpcError
from backend.settlement import models as st
from backend.settlement import services
from backend.settlement.solana import finish_from_chain
from payintent import solana_tx as stx

log = logging.getLogger(__name__)

CONFIRM_TIMEOUT_SECONDS = 60.0
_POLL_SECONDS = 0.2


def associated_account(owner: str, mint: str) -> Pubkey:
    return stx.associated_token_address(Pubkey.from_string(owner), Pubkey.from_string(mint))


def ensure_token_account(chain: SolanaChain, relay: Keypair, owner: str, mint: str) -> bool:
    """Create ``owner``'s associated USDC account, paid by the relay, if it does not exist yet.

    Never part of a buyer's transaction. Returns whether it had to be created.
    """
    owner_key, mint_key = Pubkey.from_string(owner), Pubkey.from_string(mint)
    account = stx.associated_token_address(owner_key, mint_key)
    if chain.account_exists(str(account)):
        return False
    from spl.token.instructions import create_idempotent_associated_token_account

    instruction = create_idempotent_associated_token_account(relay.pubkey(), owner_key, mint_key)
    blockhash = chain.latest_blockhash()
    message = MessageV0.try_compile(relay.pubkey(), [instruction], [], Hash.from_string(blockhash.blockhash))
    tx = VersionedTransaction(message, [relay])
    signature = chain.send(stx.encode(tx))
    if not _wait(chain, signature, CONFIRM_TIMEOUT_SECONDS):
        raise SolanaRpcError(f"creating the USDC account of {owner} was not confirmed")
    log.info("created the USDC token account of %s", owner)
    return True


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
    if chain.block_height() > settlement.valid_before:
        finish_from_chain(chain, settlement)
        return "expired"
    tx = stx.decode(settlement.signature)
    # The relay signs only what the rules allow, whatever the database holds.
    expected = {
        "asset": network.usdc_address,
        "payTo": settlement.pay_to,
        "maxAmountRequired": settlement.amount_atomic,
    }
    try:
        stx.check_payment(tx, expected, settlement.intent_id, str(relay.pubkey()))
    except stx.SolanaTransactionError as exc:
        log.error("settlement %s: refusing to co-sign (%s)", settlement.id, exc)
        services.fail_settlement(settlement.id, exc.code, f"the relay refused the transaction: {exc}")
        return "refused-by-relay"
    if not chain.account_exists(str(associated_account(settlement.pay_to, network.usdc_address))):
        return "payee-account-missing"  # the API asks for it before claiming; the reconciler retries
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
