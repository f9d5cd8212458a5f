"""The rail interface: what every chain kind implements, and the typed terms a claim stores.

A rail owns everything that differs between chain kinds (docs/architecture.md, "Rails"): what an address
is, the kind's part of a payment requirement, parsing and verifying a buyer's payment into typed terms and
mapping them to and from a settlement row's columns, the chain reads before a claim and their refusals, what a
settlement costs the relay, when a payment's terms may still execute, the relay's keys, submit and watch, what
the chain says about a claim (finish-from-chain), and the readiness probes. Rails take plain values (networks,
requirements, payloads, a settlement row's column values, a ``Claim``) and write nothing to the database: they
import no domain model, so the domains above (settlement, intents, checkout, relaybudget, merchants,
observability) and the relayer call them instead of branching on ``network.kind``.
``backend.rails.registry.rail_for`` picks the rail.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from enum import Enum
from typing import Any, Protocol

from redis import Redis

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
    """What only the settlement store knows and a rail may ask or tell: whether a payment of ours landed in
    ``owner``'s account of ``mint`` on the chain with this genesis hash (Solana's closed-account rule), and
    that one did (written before the settlement is marked paid)."""

    def landed_before(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> bool: ...

    def record_landed(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> None: ...


@dataclass(frozen=True)
class Claim:
    """A settlement as its rail sees it: the typed terms and what we know of our own transaction (recorded
    before it was broadcast). ``settlement_id`` names it in logs only."""

    settlement_id: str
    intent_id: str  # what the payment names (Solana: its memo): the intent's id, or a refund's for a refund
    asset: str
    terms: Terms
    tx_id: str | None
    relay_address: str | None
    start_block: int | None
    # EVM: the relay nonce recorded with ``tx_id`` (a second transaction only ever goes at it while it may be mined).
    relay_nonce: int | None = None
    # A refund's settlement: the merchant's wallet pays the buyer back. The settlement store hands such a claim a
    # ledger of its own (``settlement.reconcile.ledger_for``): the payee-account rule spares buyers a merchant's
    # rent, and a buyer's account is no merchant's.
    pays_refund: bool = False


class Outcome(Enum):
    """What the chain says about a claim's terms (``Rail.read_outcome``)."""

    USED = "used"  # executed with these terms (by us or anyone), final: the merchant was paid
    CANCELED = "canceled"  # the buyer cancelled it, final: it can never execute
    # The payer's nonce was used, final, by ANOTHER authorization (other recipient or amount, signed with the same
    # nonce): this one can never execute, and the merchant got nothing from it.
    USED_ELSEWHERE = "used-elsewhere"
    FAILED = "failed"  # our transaction landed and failed, final (Solana): it can never execute
    # Executed or cancelled on chain, but not final yet (or its transaction not found yet). A reorg may
    # still undo it, so it is neither paid nor released: the claim is kept until the chain decides.
    NOT_FINAL = "not-final"
    # Our transaction is known to the node but not decided yet, or a landed payment could not be recorded yet;
    # sending the same transaction again is harmless (Solana: one signature). Treated like UNUSED.
    PENDING = "pending"
    UNUSED = "unused"  # not (yet) executed, and it may still execute
    EXPIRED = "expired"  # unused, and no block that could still execute it can be final: it never will


# The outcomes that finish a settlement.
FINISHED = (Outcome.USED, Outcome.CANCELED, Outcome.USED_ELSEWHERE, Outcome.FAILED, Outcome.EXPIRED)


@dataclass(frozen=True)
class ChainOutcome:
    outcome: Outcome
    tx_id: str | None = None  # the transaction that decided it (ours or anyone's), when known
    detail: str = ""  # why it can never execute: the failure reason a settlement stores
    cost: int | None = None  # what our own transaction cost the relay once it landed (charged before finishing)


class TxState(Enum):
    UNKNOWN = "unknown"  # the node does not know it (never sent, dropped): it cannot be mined any more
    PENDING = "pending"  # known to the node, not mined (EVM) / not confirmed (Solana): it may still be
    SUCCEEDED = "succeeded"  # mined / confirmed, successful
    FAILED = "failed"  # mined / confirmed, reverted or failed


@dataclass(frozen=True)
class TxStatus:
    """One of our transactions as the chain shows it (``Rail.watch``)."""

    state: TxState
    block: int | None = None  # where it landed (what ``wait_final`` waits on)
    final: bool = False  # landed and final already (EVM: one confirmation is final; Solana: confirmed)
    cost: int | None = None  # what it cost the relay, if the status shows it (EVM: the receipt's gas)
    # PENDING: the node holds it. False (EVM): not held, but its recorded relay nonce is not consumed yet, so it may
    # still be mined (another node's pool): a submit sends again only at that nonce, and the claim is not released.
    held: bool = True
    # The transaction that landed, when ``wait_landed`` watched more than the claim's own (EVM: a replacement with
    # higher fees at its nonce, or the transaction it replaced): the one a settlement is finished with.
    tx_id: str | None = None


@dataclass(frozen=True)
class Submission:
    tx_id: str
    relay_address: str
    relay_nonce: int | None = None  # EVM: the nonce it was signed with (a fee bump's replacements share it)


class BeforeBroadcast(Protocol):
    """Called by ``Rail.submit`` with a transaction's id, sender and nonce (EVM: the nonce it was signed with;
    None on rails without account nonces, Solana) before it is broadcast (``mark_submitted``): only for an id not
    recorded yet (``Claim.tx_id``)."""

    def __call__(self, tx_id: str, relay_address: str, relay_nonce: int | None) -> None: ...


class Rerecord(Protocol):
    """The EVM fee bump's record at the nonce it waits on (``mark_submitted(expect_tx=...)``), of a replacement before
    it is broadcast and of the put-back after it went nowhere: ``tx_id`` written over ``expect_tx`` only while the
    open row still names ``expect_tx`` at (``relay_address``, ``relay_nonce``). Returns whether it was written
    (False: another attempt recorded the settlement since, after this job's lock was lost: its record stands)."""

    def __call__(self, expect_tx: str, tx_id: str, relay_address: str, relay_nonce: int) -> bool: ...


class RelayNonceTaken(Exception):
    """Raised by ``BeforeBroadcast`` when another open settlement already recorded this (relay account, nonce)
    (the unique index over open rows, migration 0012): two processes believed they owned the account. Nothing is
    broadcast at that nonce, and no cancel either: it is the other settlement's."""


class RelayKeyError(RuntimeError):
    """The relay keys are missing or do not match the chains file (the message holds no key)."""


class RelayKeys(Protocol):
    """A network's relay keys as loaded by its rail; opaque to the relayer, which holds one per network."""

    def addresses(self) -> tuple[str, ...]: ...

    def secrets(self) -> tuple[str, ...]:
        """Texts never to be logged (the keys in every form the process may print)."""

    def summary(self, network_id: str) -> str:
        """What the relayer logs at start-up."""

    def use_recorded_nonces(self, recorded_nonce: Callable[[str, str], int | None]) -> None:
        """How the relay reads the highest relay nonce settlements recorded per (network, relay address): wired by
        every relayer process before its first submit (EVM: a submit without it fails; Solana: unused)."""


class SubmitError(Exception):
    """``Rail.submit`` did not leave a transaction of ours on its way; ``result`` is the relayer job's answer."""

    def __init__(self, message: str, result: str) -> None:
        super().__init__(message)
        self.result = result


class LeftOpen(SubmitError):
    """Transient (not valid yet, the relay short of funds): nothing to decide now, the settlement stays open.
    ``loud``: the operator must act (logged as an error)."""

    def __init__(self, message: str, result: str, *, loud: bool = False) -> None:
        super().__init__(message, result)
        self.loud = loud


class CannotSucceed(SubmitError):
    """The transfer cannot succeed (it would revert, the node refused it for good, the payer has code): the chain
    decides first (someone may have executed it), then the settlement fails with ``code`` and ``reason``."""

    def __init__(self, reason: str, code: str = "SETTLEMENT_FAILED") -> None:
        super().__init__(reason, "reverted" if code == "SETTLEMENT_FAILED" else code.lower())
        self.code = code
        self.reason = reason


class RelayRefuses(SubmitError):
    """The relay will not sign it: the settlement fails now, unless a transaction the relay signed for it earlier
    may still land and this rail does not watch released settlements (then it is left open: the chain decides)."""

    def __init__(self, code: str, reason: str, result: str, *, logged: str | None = None) -> None:
        super().__init__(reason, result)
        self.code = code
        self.reason = reason
        self.logged = logged  # logged as an error when set


class ChainDecides(SubmitError):
    """Not sent (its blockhash expired) or refused by the node: the chain decides now; ``finished_result`` if it
    finished the settlement, else ``result`` (left open). ``logged``: a warning to log first."""

    def __init__(self, result: str, finished_result: str = "finished-from-chain", *, logged: str | None = None) -> None:
        super().__init__(logged or result, result)
        self.finished_result = finished_result
        self.logged = logged


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
    # The OpenAPI document's view of this kind: an address (JSON Schema) and the x402 payload's component's name.
    openapi_address: dict[str, Any]
    payload_component: str
    # The settlement columns only this rail's terms fill (NULL on other rails' rows; a CHECK says so).
    columns: tuple[str, ...]

    # Addresses and requirements
    def normalize_address(self, address: str) -> str:
        """The canonical form of ``address``; raises ``chains.addresses.AddressError`` (message safe to show)."""

    def new_wallet(self) -> tuple[str, str]:
        """A new random account of this kind: (address, private key in the form its wallets import). For the dev
        stack's demo merchant (``harness.bootstrap``), whose keys ``var/demo.json`` lists."""

    def same_address(self, a: str, b: str) -> bool:
        """Whether two addresses of this kind name the same account (EVM: hex letters in any case; Solana: exact)."""

    def signed_message_by(self, address: str, message: str, signature: str) -> bool:
        """Whether ``signature`` is ``address``'s signature of the text ``message``, as its wallets sign messages
        (EVM: EIP-191 ``personal_sign``, 65 bytes 0x-hex; Solana: ed25519 over the UTF-8 bytes, 64 bytes base64).
        A malformed signature is False, never an error."""

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
        """Whether ``terms`` (this rail's) may still execute when the chain's "now" is ``chain_now`` (EVM: a final
        block's timestamp, against ``valid_before``; Solana: a block height, against ``last_valid_block_height``).
        Every such comparison goes through this (the reconciler's, and the Solana relay's last-moment check
        before it signs)."""

    def released_may_execute(self) -> bool:
        """Whether a released (failed) settlement's terms may still execute on chain (and need watching). False
        (Solana): nothing watches a released settlement, so one is never released while a transaction of ours for
        it may still land (the relayer leaves it open until the chain decides)."""

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

    spend_kind: str  # what the relay's cost of a transaction is recorded as (relay_spending.kind: "gas", "fee")

    # The relay: keys, submit, watch
    # A second ``submit`` for a claim sends the very same transaction (Solana: the relay's signature over the same
    # message), so one seen but not landed (``TxState.PENDING``) is sent again, harmlessly; False (EVM): a second
    # submit is a new transaction, never sent while ours is pending.
    resends_same_transaction: bool

    def load_relay_keys(self, network: Network, secrets: Sequence[str]) -> RelayKeys | None:
        """The relay's keys for ``network`` from the key file's entry (None: none); raises RelayKeyError when they
        are malformed or do not match the chains file."""

    def check_relay_network(self, network: Network) -> None:
        """At the relayer's start: raise RelayKeyError if the RPC answers as another chain (nothing is signed
        for it); an unreachable RPC is logged and left to each job."""

    def submit(
        self,
        network: Network,
        claim: Claim,
        keys: RelayKeys,
        leases: Redis,
        ledger: PayeeLedger,
        before_broadcast: BeforeBroadcast,
    ) -> Submission:
        """The last checks before sending (the payer's code and validAfter on EVM; the blockhash's height, the
        relay's own check of what it signs and the payee account on Solana), then build, sign and broadcast the
        settlement transaction with the relay's keys (``leases``: the relay accounts' leases and nonces).
        ``before_broadcast`` runs before a new transaction id is broadcast. Raises a ``SubmitError``."""

    def watch(self, network: Network, claims: Sequence[Claim]) -> dict[str, TxStatus]:
        """The status of each claim's own transaction (``Claim.tx_id``), by id; one look, many per call."""

    def wait_landed(
        self, network: Network, claim: Claim, timeout: float, rerecord: Rerecord | None = None
    ) -> TxStatus | None:
        """Wait up to ``timeout`` for the claim's transaction to land (mined / confirmed); None if it did not. EVM:
        a transaction this process sent in the same job that stays unmined under fees the chain has outgrown is
        replaced at its nonce with higher fees while it waits (recorded first with ``rerecord``; none without it);
        the status's ``tx_id`` names the one that landed when it is not ``claim.tx_id``."""

    def wait_final(self, network: Network, status: TxStatus, timeout: float) -> bool:
        """Wait up to ``timeout`` until a landed transaction's block is final (the network's confirmations)."""

    # Finishing from the chain
    def read_outcome(
        self,
        network: Network,
        claim: Claim,
        *,
        deadline: float | None = None,
        pins: MutableMapping[str, int] | None = None,
        with_cost: bool = True,
    ) -> ChainOutcome:
        """What the chain says about the claim's terms (executed by anyone and final, not final, can never
        execute, still executable), with the cost of our own landed transaction (``with_cost``). ``deadline``:
        of a log search (``time.monotonic()``); ``pins``: reads shared by the calls of one watch tick (the
        height), kept by the caller. An RPC error raises: it is never taken for an answer."""

    def before_paid(self, network: Network, claim: Claim, ledger: PayeeLedger) -> bool:
        """What must be recorded before a landed payment is marked paid (Solana: the payee account, in
        ``ledger``); False if it cannot be now (the settlement is left open)."""

    # Operations
    def probe(self, network: Network, timeout: float) -> Probe:
        """A short-timeout RPC client for readiness and the relay's balances."""
