"""The rail interface: what every chain kind implements, and the typed terms a claim stores.

A rail owns everything that differs between chain kinds on the API side (docs/architecture.md,
"Rails"): what an address is, the kind's part of a payment requirement, parsing and verifying a
buyer's payment into typed terms, the chain reads before a claim and their refusals, what a
settlement costs the relay, when a payment's terms may still execute, and the readiness probes.
Rails take plain values (networks, requirements, payloads, a settlement row's column values): they import no
domain model, so the domains above (settlement, intents, checkout, relaybudget, merchants, observability) call
them instead of branching on ``network.kind``. ``backend.rails.registry.rail_for`` picks the rail.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Protocol

from backend.chains.registry import Network
from backend.config import Settings


class Terms(Protocol):
    """A checked payment: what every rail's terms have (the settlement row's common columns, ``COMMON_COLUMNS``).

    Each rail's terms type adds its own fields, stored in that rail's own columns (``Rail.columns``):
    ``EvmTerms`` the EIP-3009 window (unix times) and signature, ``SolanaTerms`` the buyer-signed transaction
    and the block height its blockhash surely expired by. Only the rail reads them (``Rail.may_still_execute``).
    """

    @property
    def payer(self) -> str: ...
    @property
    def pay_to(self) -> str: ...
    @property
    def value(self) -> int: ...
    @property
    def nonce_hex(self) -> str:
        """What makes the payment unique for its payer on its network (the row's ``nonce``, in the unique
        (network, payer, nonce)): EVM the EIP-3009 nonce, Solana the sha256 of the signed message."""
        ...


# The settlement columns every rail's terms fill, whatever the rail; ``common_columns`` writes them.
COMMON_COLUMNS = ("payer", "pay_to", "amount_atomic", "nonce")


def common_columns(terms: Terms) -> dict[str, Any]:
    """The common settlement columns of ``terms`` (every rail's ``columns_of`` starts with these)."""
    return {"payer": terms.payer, "pay_to": terms.pay_to, "amount_atomic": terms.value, "nonce": terms.nonce_hex}


@dataclass(frozen=True)
class Checked:
    """Terms the chain was asked about before the claim, and the block the relay's search starts at (EVM)."""

    terms: Terms
    start_block: int | None


class PayeeLedger(Protocol):
    """What only the settlement store knows and a rail may ask: whether a payment of ours landed in
    ``owner``'s account of ``mint`` on the chain with this genesis hash (Solana's closed-account rule)."""

    def landed_before(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> bool: ...


class ProbeError(RuntimeError):
    """A probe's answer was wrong or it could not run (its message names no URL and is shown as is)."""


class Probe(Protocol):
    """One network's RPC with a short timeout, for /readyz and the relay balance gauges."""

    def check(self) -> None:
        """Raises unless the RPC answers as this network."""

    def balances(self) -> dict[str, Decimal]:
        """Native-coin balances of the network's relay accounts, in coins."""


class Rail(Protocol):
    """One chain kind's code. Every method takes the network it acts on (a rail serves every network of its kind)."""

    kind: str
    namespace: str  # the CAIP-2 namespace of its network ids ("eip155", "solana"): a row's network names its rail
    label: str  # shown to merchants: "EVM", "Solana"
    asset_noun: str  # what the USDC address is: "contract", "mint"
    address_hint: str  # what a valid address looks like, for forms
    example_address: str  # a well-known valid address, no one's wallet here (the dev stack's demo payout wallet)
    # The buyer signs a transaction the service prepares (``settlement.solana.prepare_transaction``, the
    # /solana-transaction endpoints) rather than typed data its wallet builds itself.
    prepares_transaction: bool
    # The settlement columns only this rail's terms fill (NULL on other rails' rows; a CHECK says so).
    columns: tuple[str, ...]

    # Addresses and requirements
    def normalize_address(self, address: str) -> str:
        """The canonical form of ``address``; raises ``chains.addresses.AddressError`` (message safe to show)."""

    def reserved_addresses(self) -> dict[str, str]:
        """Addresses of this kind that are never a merchant's wallet on any network (programs), with what each is."""

    def relay_accounts(self, network: Network) -> tuple[str, ...]:
        """The addresses the relay spends from on ``network`` (from the chains file)."""

    def domain_name(self, network: Network) -> str | None:
        """The token's signing domain name a requirement names (None: this kind's requirements name none): from
        the chains file, else read once from the chain (raises when it cannot be read)."""

    def requirement_fields(self, network: Network, domain_name: str | None) -> dict[str, Any]:
        """This kind's fields of an x402 ``exact`` requirement (``extra`` and any others)."""

    # A buyer's payment
    def parse_payment(
        self, network: Network, requirement: dict[str, Any], payload: Any, intent_id: str, now: datetime
    ) -> Terms:
        """The payload's terms, checked offline against the requirement (shape, recipient, amount, window,
        signature); raises DomainError with the code the API answers."""

    def check_on_chain(
        self, network: Network, requirement: dict[str, Any], terms: Terms, ledger: PayeeLedger
    ) -> Checked:
        """The chain reads before a claim (one round of reads, batchable) and the refusals they decide; raises
        DomainError (503 CHAIN_UNAVAILABLE when the chain cannot be read)."""

    # What a settlement row stores
    def columns_of(self, terms: Terms) -> dict[str, Any]:
        """The settlement columns ``terms`` fill: ``COMMON_COLUMNS`` and this rail's ``columns``."""

    def terms_from_columns(self, columns: Mapping[str, Any]) -> Terms:
        """The typed terms of a settlement row, from its ``COMMON_COLUMNS`` and this rail's ``columns`` (the
        values ``columns_of`` wrote)."""

    def token_balance(self, network: Network, address: str) -> int:
        """``address``'s USDC balance in atomic units (0 without a token account); raises on RPC trouble."""

    def may_still_execute(self, terms: Terms, chain_now: int) -> bool:
        """Whether ``terms`` (this rail's) may still execute when the chain's final "now" is ``chain_now`` (EVM: a
        block timestamp, against ``valid_before``; Solana: a finalized block height, against
        ``last_valid_block_height``). The reconciler compares only through this; the Solana relayer's own
        last-moment check (``relayer/solana.py``) moves behind it in stage 2."""

    def released_may_execute(self) -> bool:
        """Whether a released (failed) settlement's terms may still execute on chain (and need watching)."""

    # The relay's costs
    def native_decimals(self, network: Network) -> int:
        """Decimals of the coin the relay pays fees in (wei, lamports)."""

    def relay_budget_coins(self, settings: Settings) -> Decimal | None:
        """The default per-merchant relay budget of this kind, in coins (None: unlimited)."""

    def cost_floor(self, network: Network) -> int:
        """The most one settlement costs the relay by its own limits (smallest native unit); may read the chain."""

    def cost_learned_from_history(self) -> bool:
        """Whether a merchant's past charges may raise the estimate above ``cost_floor`` (EVM: fees the limits
        do not bound); False when ``cost_floor`` is exact."""

    def settlement_cost(self, terms: Terms, most: int) -> int:
        """What this settlement costs the relay at most, given the kind's most for any (``most``)."""

    # Operations
    def probe(self, network: Network, timeout: float) -> Probe:
        """A short-timeout RPC client for readiness and the relay's balances."""
