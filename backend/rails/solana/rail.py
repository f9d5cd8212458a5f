"""The Solana rail: a buyer-signed SPL transfer (``payintent.solana_tx``) our relay co-signs as fee payer.

The relay pays transaction fees only, never an account's rent (``settlement.solana`` builds the
transaction the buyer signs). A buyer-signed transaction is checked instruction by instruction
offline (``parse_payment``), then on chain: the merchant's USDC account (missing, or closed after
payments of ours landed in it: the ``PayeeLedger`` knows), a simulation without signature
verification (the relay has not signed yet) and the block height its blockhash expires after.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from redis import Redis
from solders.pubkey import Pubkey

from backend.chains.addresses import SOLANA_ADDRESS_PATTERN, normalize_solana_address
from backend.chains.registry import Network
from backend.chains.solana import SolanaChain, SolanaRpcError, solana_chain
from backend.config import Settings
from backend.errors import ChainUnavailable, DomainError
from backend.rails.base import (
    BeforeBroadcast,
    ChainOutcome,
    Checked,
    Claim,
    PayeeLedger,
    ProbeError,
    RelayKeys,
    Rerecord,
    Submission,
    Terms,
    TxStatus,
    common_columns,
)
from backend.rails.solana import outcome
from backend.rails.solana import relay as relay_module
from backend.rails.solana.terms import SolanaTerms as SolanaTerms
from payintent import solana_tx as stx

log = logging.getLogger(__name__)

SOLANA_DECIMALS = 9  # lamports per SOL: 10**9
# A blockhash is usable for about 150 blocks; 300 (the size of the node's blockhash queue) leaves
# room for RPC lag and off-by-one at the edges before the reconciler may call a transaction dead.
BLOCKHASH_MARGIN = 300
# Programs a Solana payment calls: no one holds their keys, so USDC sent to their accounts would be lost.
PROGRAMS = {
    "TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA": "the SPL Token program",
    "ATokenGPvbdGVxr1b2hvZbsiqW5xWH25efTNsLJA8knL": "the Associated Token Account program",
    "ComputeBudget111111111111111111111111111111": "the Compute Budget program",
    "MemoSq4gqABAXKb96qnH8TysNcWxMyWCqXgDLGmfcHr": "the Memo program",
}


def unavailable(network: Network, exc: Exception) -> DomainError:
    log.warning("Solana RPC for %s failed: %s", network.network, type(exc).__name__)
    return ChainUnavailable(network.name)


def relay(network: Network) -> str:
    if not network.fee_payer:
        raise ChainUnavailable(network.name, f"No relay (fee payer) is configured for {network.name}")
    return network.fee_payer


def payee_account_ready(chain: SolanaChain, requirement: dict[str, Any]) -> bool:
    """Whether the merchant's USDC account is a token account now. Not merely "an account exists":
    anyone can send lamports to its address, which CreateIdempotent still turns into the account."""
    account = stx.associated_token_address(
        Pubkey.from_string(requirement["payTo"]), Pubkey.from_string(requirement["asset"])
    )
    return chain.token_balance(str(account)) is not None


def account_closed(network: Network) -> DomainError:
    return DomainError(
        "PAYEE_ACCOUNT_CLOSED",
        f"The merchant closed its USDC account on {network.name} after it received payments there; the merchant "
        f"must open it again before it can be paid on {network.name} (a buyer does not pay to open it twice). "
        f"Pay on another network, or later",
        network=network.network,
    )


def payee_closed(chain: SolanaChain, network: Network, requirement: dict[str, Any], ledger: PayeeLedger) -> bool:
    """Whether a payment of ours landed in the requirement's payee account on this chain (same genesis hash):
    if the account is missing now, its owner closed it. Raises SolanaRpcError if the genesis hash cannot be read."""
    return ledger.landed_before(network.network, requirement["payTo"], requirement["asset"], chain.genesis_hash())


class _Probe:
    def __init__(self, network: Network, timeout: float) -> None:
        self.network = network
        self.solana = SolanaChain(network.rpc_url or "", timeout=timeout)

    def check(self) -> None:
        health = self.solana.call("getHealth")
        if health != "ok":
            raise ProbeError("getHealth did not answer ok")

    def balances(self) -> dict[str, Decimal]:
        payer = self.network.fee_payer
        raw = {payer: self.solana.call("getBalance", [payer, {"commitment": "confirmed"}])["value"]} if payer else {}
        scale = Decimal(10) ** SOLANA_DECIMALS
        return {address: Decimal(int(value)) / scale for address, value in raw.items()}


class SolanaRail:
    kind = "solana"
    namespace = "solana"
    label = "Solana"
    asset_noun = "mint"
    address_hint = "A base58 public key"
    example_address = "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM"  # the example key of Solana's documentation
    prepares_transaction = True  # settlement.solana.prepare_transaction: the buyer's wallet signs it as is
    openapi_address: dict[str, Any] = {
        "type": "string",
        "pattern": SOLANA_ADDRESS_PATTERN,
        "description": "base58 of a 32-byte key",
    }
    payload_component = "X402SolanaPayload"
    resends_same_transaction = True  # the relay's signature over the same message is the transaction id
    # The buyer-signed transaction (base64) and the block height its blockhash surely expired by.
    columns: tuple[str, ...] = ("last_valid_block_height", "signed_transaction")

    def new_wallet(self) -> tuple[str, str]:
        from solders.keypair import Keypair

        keypair = Keypair()
        return str(keypair.pubkey()), str(keypair)  # base58 of the 64-byte secret, as Phantom and Solflare import it

    def normalize_address(self, address: str) -> str:
        return normalize_solana_address(address)

    def same_address(self, a: str, b: str) -> bool:
        return a == b  # base58 is case-sensitive

    def signed_message_by(self, address: str, message: str, signature: str) -> bool:
        import base64
        import binascii

        from solders.signature import Signature

        try:
            raw = base64.b64decode(signature, validate=True) if isinstance(signature, str) else b""
            return len(raw) == 64 and Signature.from_bytes(raw).verify(Pubkey.from_string(address), message.encode())
        except (binascii.Error, ValueError):
            return False

    def reserved_addresses(self) -> dict[str, str]:
        return dict(PROGRAMS)

    def relay_accounts(self, network: Network) -> tuple[str, ...]:
        return (network.fee_payer,) if network.fee_payer else ()

    def domain_name(self, network: Network) -> None:
        return None

    def requirement_fields(self, network: Network, domain_name: str | None) -> dict[str, Any]:
        extra: dict[str, Any] = {"decimals": network.decimals}
        if network.fee_payer:
            extra["feePayer"] = network.fee_payer
        return {"extra": extra}

    def parse_payment(
        self, network: Network, requirement: dict[str, Any], payload: Any, intent_id: str, now: datetime
    ) -> SolanaTerms:
        """Every rule of payintent.solana_tx (offline). ``last_valid_block_height`` is set by ``check_on_chain``."""
        fee_payer = relay(network)
        try:
            tx = stx.decode(payload.get("transaction"))
            payment = stx.check_payment(tx, requirement, intent_id, fee_payer)
        except stx.SolanaTransactionError as exc:
            raise DomainError(exc.code, str(exc)) from None
        return SolanaTerms(
            payer=payment.payer,
            pay_to=requirement["payTo"],
            value=payment.amount_atomic,
            last_valid_block_height=0,
            nonce_hex="0x" + payment.message_hash,
            transaction=stx.encode(tx),
            creates_payee_account=payment.creates_payee_account,
        )

    def check_on_chain(
        self, network: Network, requirement: dict[str, Any], terms: Terms, ledger: PayeeLedger
    ) -> Checked:
        """The merchant's USDC account, then a simulation (no signature check: the relay signs later), then the
        height its blockhash expires after.

        A transaction that does not open the merchant's USDC account needs it to exist: if it is gone
        (closed since the transaction was prepared), 409 PAYEE_ACCOUNT_MISSING asks for a new one
        (which opens it). An account closed after payments landed in it on this chain is opened by no
        buyer: 409 PAYEE_ACCOUNT_CLOSED, whichever transaction comes.
        """
        assert isinstance(terms, SolanaTerms)
        chain = solana_chain(network)
        try:
            ready = payee_account_ready(chain, requirement)
            if not ready and payee_closed(chain, network, requirement, ledger):
                raise account_closed(network)
            if not terms.creates_payee_account and not ready:
                raise DomainError(
                    "PAYEE_ACCOUNT_MISSING",
                    "The merchant's USDC account does not exist (any more); fetch a new transaction, which opens it",
                )
            simulation = chain.simulate(terms.transaction, sig_verify=False)
            height = chain.block_height("processed")  # after the simulation: a blockhash it accepted is older
        except SolanaRpcError as exc:
            raise unavailable(network, exc) from None
        if simulation.err is not None:
            text = str(simulation.err)
            if "BlockhashNotFound" in text:
                raise DomainError("BLOCKHASH_EXPIRED", "The transaction's blockhash expired; fetch a new transaction")
            if "AlreadyProcessed" in text:
                raise DomainError("NONCE_ALREADY_USED", "This transaction was already processed")
            detail = next((line for line in reversed(simulation.logs) if "Error" in line or "failed" in line), text)
            raise DomainError("SETTLEMENT_FAILED", "The payment would fail on chain", reason=f"simulation: {detail}")
        return Checked(dataclasses.replace(terms, last_valid_block_height=height + BLOCKHASH_MARGIN), None)

    def columns_of(self, terms: Terms) -> dict[str, Any]:
        assert isinstance(terms, SolanaTerms)
        own = {"last_valid_block_height": terms.last_valid_block_height, "signed_transaction": terms.transaction}
        return {**common_columns(terms), **own}

    def terms_from_columns(self, columns: Mapping[str, Any]) -> SolanaTerms:
        return SolanaTerms(
            payer=columns["payer"],
            pay_to=columns["pay_to"],
            value=int(columns["amount_atomic"]),
            last_valid_block_height=int(columns["last_valid_block_height"]),
            nonce_hex=columns["nonce"],
            transaction=columns["signed_transaction"],
        )

    def token_balance(self, network: Network, address: str) -> int:
        account = stx.associated_token_address(Pubkey.from_string(address), Pubkey.from_string(network.usdc_address))
        return solana_chain(network).token_balance(str(account)) or 0

    def may_still_execute(self, terms: Terms, chain_now: int) -> bool:
        # ``chain_now``: a block height (finalized for the reconciler; the relay's confirmed one before it signs);
        # past last_valid_block_height the blockhash has surely expired (read_outcome also asks the node whether
        # it still accepts the blockhash).
        assert isinstance(terms, SolanaTerms)
        return chain_now <= terms.last_valid_block_height

    def released_may_execute(self) -> bool:
        return False  # a failed Solana transaction can never land again

    def native_decimals(self, network: Network) -> int:
        return SOLANA_DECIMALS

    def relay_budget_coins(self, settings: Settings) -> Decimal | None:
        return settings.relay_budget_solana

    def cost_floor(self, network: Network) -> int:
        # Exact: two signatures and the largest priority fee the rules let a buyer sign.
        return stx.MAX_TRANSACTION_FEE

    def cost_learned_from_history(self) -> bool:
        return False

    def settlement_cost(self, terms: Terms, most: int) -> int:
        assert isinstance(terms, SolanaTerms)
        return stx.transaction_fee(stx.decode(terms.transaction).message)  # exact, from the signed message

    spend_kind = "fee"

    def load_relay_keys(self, network: Network, secrets: Sequence[str]) -> RelayKeys | None:
        return relay_module.load_keys(network, secrets)

    def check_relay_network(self, network: Network) -> None:
        return None  # the fee payer signs messages bound to a blockhash of the chain /pay read

    def submit(
        self,
        network: Network,
        claim: Claim,
        keys: RelayKeys,
        leases: Redis,
        ledger: PayeeLedger,
        before_broadcast: BeforeBroadcast,
    ) -> Submission:
        assert isinstance(keys, relay_module.SolanaRelayKeys)
        return relay_module.submit(network, claim, keys.keypair, ledger, self.may_still_execute, before_broadcast)

    def watch(self, network: Network, claims: Sequence[Claim]) -> dict[str, TxStatus]:
        return relay_module.watch(solana_chain(network), claims)

    def wait_landed(
        self, network: Network, claim: Claim, timeout: float, rerecord: Rerecord | None = None
    ) -> TxStatus | None:
        timeout = min(timeout, relay_module.CONFIRM_TIMEOUT_SECONDS)
        return relay_module.wait_landed(solana_chain(network), claim, timeout, self.may_still_execute)

    def wait_final(self, network: Network, status: TxStatus, timeout: float) -> bool:
        return status.final  # confirmed is what a payment waits for (a failure is final once confirmed)

    def read_outcome(
        self,
        network: Network,
        claim: Claim,
        *,
        deadline: float | None = None,
        pins: MutableMapping[str, int] | None = None,
        with_cost: bool = True,
    ) -> ChainOutcome:
        return outcome.read_outcome(solana_chain(network), claim, self.may_still_execute)

    def before_paid(self, network: Network, claim: Claim, ledger: PayeeLedger) -> bool:
        return outcome.before_paid(solana_chain(network), network.network, claim, ledger)

    def probe(self, network: Network, timeout: float) -> _Probe:
        return _Probe(network, timeout)


# The one instance: the registry serves it and the stage-1 leftovers outside the rail use it, so a rail is
# one object (code may compare rails by identity).
SOLANA_RAIL = SolanaRail()
