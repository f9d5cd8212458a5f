"""The EVM rail: EIP-3009 ``transferWithAuthorization`` of USDC, submitted by our relay accounts (they pay gas)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import requests
from eth_utils import function_signature_to_4byte_selector
from redis import Redis
from web3 import Web3

from backend.chains.addresses import EVM_ADDRESS_PATTERN, normalize_evm_address
from backend.chains.evm import domain_name, evm_chain
from backend.chains.registry import Network
from backend.config import Settings
from backend.errors import ChainUnavailable, DomainError
from backend.money import from_atomic
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
from backend.rails.evm import feebump, outcome, relay, sender, watch
from backend.rails.evm.relay import EVM_SETTLEMENT_GAS
from backend.rails.evm.rpcbatch import RpcCounter, call_many, strict_quantity
from backend.rails.evm.terms import PAYLOAD_FIELDS, EvmTerms, parse_evm_payload, verify_evm_authorization
from backend.timing import step

log = logging.getLogger(__name__)

# The most Retry-After of a validAfter the chain's latest block has not passed yet (it passed by our clock).
NOT_YET_VALID_RETRY_MAX_SECONDS = 60
# EXPIRY_GRACE_SECONDS (rails/evm/outcome.py): an unexecuted authorization is given up on only this long after
# validBefore. EVM_SETTLEMENT_GAS (rails/evm/relay.py): the gas bound and limit of every relay transaction.
COST_CACHE_SECONDS = 30.0
# network -> (monotonic time read, cost floor): the gas price is read at most every COST_CACHE_SECONDS.
cost_cache: dict[str, tuple[float, int]] = {}


@dataclass(frozen=True)
class PreClaimState:
    """What /pay reads from an EVM chain before the claim, in one JSON-RPC batch (``read_pre_claim_state``)."""

    nonce_used: bool
    payer_has_code: bool
    balance: int
    latest_block: int
    latest_time: int


# The pre-claim reads' calldata: the token's two views, ABI-encoded here (a selector, then 32-byte words).
_AUTHORIZATION_STATE = function_signature_to_4byte_selector("authorizationState(address,bytes32)")
_BALANCE_OF = function_signature_to_4byte_selector("balanceOf(address)")
# A lone counter: the pre-claim reads ask for batches; a node that refuses them is asked one call each
# (``rpcbatch.call_many``), and this remembers that for every /pay of the process.
_PRE_CLAIM_RPC: dict[str, RpcCounter] = {}


def _word(address: str) -> bytes:
    return bytes(12) + bytes.fromhex(normalize_evm_address(address)[2:])


def read_pre_claim_state(network: Network, terms: EvmTerms) -> PreClaimState:
    """The nonce's state, the payer's code and USDC balance and the latest block, in one JSON-RPC batch (one round
    trip). JSON-RPC leaves the order of a batch's answers to the node (a provider may run them at once, a proxy
    split them), as separate calls could meet different backends before: the block may be a few newer than the
    state read, which the search for the authorization's use allows for (it starts a margin below, see
    ``outcome``). Answers are parsed strictly: anything but one 0/1 word, one word, hex code and a block with a hex
    number and time is the chain's trouble (503), never a decision."""
    chain = evm_chain(network)
    token, payer = network.usdc_address, terms.payer
    calls: list[tuple[str, Sequence[Any]]] = [
        _view(token, _AUTHORIZATION_STATE + _word(payer) + terms.nonce),
        ("eth_getCode", [payer, "latest"]),
        _view(token, _BALANCE_OF + _word(payer)),
        ("eth_getBlockByNumber", ["latest", False]),
    ]
    try:
        with step("chain_reads"):
            counter = _PRE_CLAIM_RPC.get(network.network) or _PRE_CLAIM_RPC.setdefault(network.network, RpcCounter())
            answers = call_many(chain.w3, calls, counter)
        errors = [answer.error for answer in answers if not answer.ok]
        if errors:
            raise ValueError(errors[0])
        used, code, balance, block = (answer.result for answer in answers)
        if not isinstance(block, Mapping):
            raise ValueError("no latest block")
        state = PreClaimState(
            nonce_used=_bool(used),
            payer_has_code=len(_hex_bytes(code)) > 0,
            balance=_uint(balance),
            latest_block=strict_quantity(block.get("number")),
            latest_time=strict_quantity(block.get("timestamp")),
        )
    except Exception as exc:  # RPC down, timeouts, malformed answers (the text may hold the RPC URL)
        log.warning("chain %s unreachable during /pay (%s)", network.network, type(exc).__name__)
        raise ChainUnavailable(network.name) from None
    return state


def _view(contract: str, data: bytes) -> tuple[str, Sequence[Any]]:
    return "eth_call", [{"to": contract, "data": "0x" + data.hex()}, "latest"]


def _hex_bytes(value: Any) -> bytes:
    if not isinstance(value, str) or not value.startswith("0x"):
        raise ValueError("not a hex string")
    return bytes.fromhex(value[2:])


def _uint(value: Any) -> int:
    """A view's one-word answer as an unsigned integer (an empty or short answer: no such view)."""
    data = _hex_bytes(value)
    if len(data) != 32:
        raise ValueError(f"a {len(data)}-byte answer where one word was due")
    return int.from_bytes(data, "big")


def _bool(value: Any) -> bool:
    """A view's bool: one word, 0 or 1 (anything else is no answer of the token's, as web3's decoding held)."""
    number = _uint(value)
    if number > 1:
        raise ValueError("a bool that is neither 0 nor 1")
    return number == 1


def refuse(network: Network, terms: EvmTerms, state: PreClaimState) -> None:
    """The refusals the pre-claim reads decide: a used nonce, a validAfter the chain has not passed, a payer
    with code, too low a balance."""
    if state.nonce_used:
        raise DomainError("NONCE_ALREADY_USED", "This authorization's nonce was already used or cancelled")
    chain_time = state.latest_time
    if terms.valid_after >= chain_time:
        # Past by our clock, not by the chain's: the token needs block.timestamp > validAfter, so the relay's
        # transaction would revert now (a chain's latest block may be seconds old). Try again shortly.
        wait = min(max(terms.valid_after - chain_time + 1, 1), NOT_YET_VALID_RETRY_MAX_SECONDS)
        raise DomainError(
            "AUTHORIZATION_NOT_YET_VALID",
            f"validAfter has not passed on {network.name} yet (its latest block is from {chain_time}); "
            f"try again in {wait} s, or sign with validAfter 0",
            headers={"Retry-After": str(wait)},
            retry_after=wait,
        )
    if state.payer_has_code:
        # The token would ask the payer's code whether the signature is valid, and code may answer one
        # way when the relay estimates and another when the transaction is mined (docs/security.md).
        raise DomainError(
            "PAYER_HAS_CODE",
            "The paying address has contract code (a smart wallet or an EIP-7702 delegation); "
            "this service settles payments from plain addresses only: pay from another wallet",
        )
    if state.balance < terms.value:
        raise DomainError(
            "SETTLEMENT_FAILED",
            "The buyer's USDC balance is too low for this payment",
            reason=f"insufficient balance: {from_atomic(state.balance)} USDC available, "
            f"{from_atomic(terms.value)} USDC required",
        )


class _Probe:
    """Not ``chains.evm.evm_chain``: its 10 s timeout suits settlement, and its provider caches
    ``eth_chainId``, which would answer a readiness probe without asking the RPC."""

    def __init__(self, network: Network, timeout: float) -> None:
        self.network = network
        session = requests.Session()
        session.proxies = requests.utils.get_environ_proxies(network.rpc_url or "")
        session.trust_env = False
        provider = Web3.HTTPProvider(network.rpc_url, request_kwargs={"timeout": timeout}, session=session)
        self.w3 = Web3(provider)

    def check(self) -> None:
        answered = int(self.w3.eth.chain_id)
        if answered != self.network.chain_id:
            raise ProbeError(f"answers chain id {answered}, not {self.network.chain_id}")

    def balances(self) -> dict[str, Decimal]:
        scale = Decimal(10) ** self.network.native_currency[2]
        return {
            a: Decimal(int(self.w3.eth.get_balance(Web3.to_checksum_address(a)))) / scale
            for a in self.network.relay_addresses
        }


class EvmRail:
    kind = "evm"
    namespace = "eip155"
    label = "EVM"
    asset_noun = "contract"
    address_hint = "0x followed by 40 hex characters"
    example_address = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # Anvil's test account 1
    prepares_transaction = False  # the buyer's wallet signs EIP-712 typed data (checkout-ui/src/evm.ts)
    openapi_address: dict[str, Any] = {"type": "string", "pattern": EVM_ADDRESS_PATTERN}
    payload_component = "X402EvmPayload"
    resends_same_transaction = False  # each send is a new transaction (its own relay nonce)
    # The EIP-3009 window (unix times) and the buyer's signature (0x-hex, 65 bytes).
    columns: tuple[str, ...] = ("valid_after", "valid_before", "signature")

    def new_wallet(self) -> tuple[str, str]:
        from eth_account import Account

        account = Account.create()
        return account.address, "0x" + bytes(account.key).hex()

    def normalize_address(self, address: str) -> str:
        return normalize_evm_address(address)

    def same_address(self, a: str, b: str) -> bool:
        return a.lower() == b.lower()  # EIP-55 case is a checksum, not part of the address

    def signed_message_by(self, address: str, message: str, signature: str) -> bool:
        from eth_account import Account
        from eth_account.messages import encode_defunct

        if not isinstance(signature, str) or not re.fullmatch(r"0x[0-9a-fA-F]{130}", signature):
            return False
        try:
            signer = Account.recover_message(encode_defunct(text=message), signature=signature)
        except Exception:  # an invalid v, an off-curve r: no one's signature
            return False
        return self.same_address(signer, address)

    def reserved_addresses(self) -> dict[str, str]:
        return {}

    def relay_accounts(self, network: Network) -> tuple[str, ...]:
        return network.relay_addresses

    def domain_name(self, network: Network) -> str:
        return domain_name(network)

    def requirement_fields(self, network: Network, domain_name: str | None) -> dict[str, Any]:
        return {
            "usdcDomainName": domain_name,
            "extra": {"name": domain_name, "version": network.usdc_domain_version},
        }

    def parse_payment(
        self, network: Network, requirement: dict[str, Any], payload: Any, intent_id: str, now: datetime
    ) -> EvmTerms:
        terms = parse_evm_payload(payload)
        verify_evm_authorization(terms, requirement, int(now.timestamp()))
        return terms

    def check_on_chain(
        self, network: Network, requirement: dict[str, Any], terms: Terms, ledger: PayeeLedger
    ) -> Checked:
        assert isinstance(terms, EvmTerms)
        state = read_pre_claim_state(network, terms)
        refuse(network, terms, state)
        return Checked(terms, state.latest_block)

    def columns_of(self, terms: Terms) -> dict[str, Any]:
        assert isinstance(terms, EvmTerms)
        own = {"valid_after": terms.valid_after, "valid_before": terms.valid_before, "signature": terms.signature_hex}
        return {**common_columns(terms), **own}

    def terms_from_columns(self, columns: Mapping[str, Any]) -> EvmTerms:
        """The row's authorization; ``raw`` (what the signature was checked over) is rebuilt from the columns."""
        values = (
            columns["payer"], columns["pay_to"], str(columns["amount_atomic"]), str(columns["valid_after"]),
            str(columns["valid_before"]), columns["nonce"], columns["signature"],
        )  # fmt: skip
        return EvmTerms(
            payer=columns["payer"],
            pay_to=columns["pay_to"],
            value=int(columns["amount_atomic"]),
            valid_after=int(columns["valid_after"]),
            valid_before=int(columns["valid_before"]),
            nonce=bytes.fromhex(columns["nonce"].removeprefix("0x")),
            signature_hex=columns["signature"],
            raw=dict(zip(PAYLOAD_FIELDS, values, strict=True)),
        )

    def token_balance(self, network: Network, address: str) -> int:
        return evm_chain(network).balance_of(address)

    def may_still_execute(self, terms: Terms, chain_now: int) -> bool:
        assert isinstance(terms, EvmTerms)
        return outcome.may_still_execute(terms.valid_before, chain_now)

    def released_may_execute(self) -> bool:
        return True  # the buyer's signature is out: anyone may submit it until validBefore

    def native_decimals(self, network: Network) -> int:
        return network.native_currency[2]

    def relay_budget_coins(self, settings: Settings) -> Decimal | None:
        return settings.relay_budget_evm

    def cost_floor(self, network: Network) -> int:
        """``EVM_SETTLEMENT_GAS`` at twice the node's gas price (the relayer's fee cap is twice the base fee plus
        the tip), cached per network and process. Raises 503 CHAIN_UNAVAILABLE if the gas price cannot be read
        and none was read before."""
        cached = cost_cache.get(network.network)
        if cached is not None and time.monotonic() - cached[0] < COST_CACHE_SECONDS:
            return cached[1]
        try:
            price = int(evm_chain(network).w3.eth.gas_price)
        except Exception as exc:  # RPC down, timeouts, malformed answers (the text may hold the RPC URL)
            log.warning("gas price of %s unreadable (%s)", network.network, type(exc).__name__)
            if cached is not None:
                return cached[1]
            raise ChainUnavailable(network.name) from None
        floor = EVM_SETTLEMENT_GAS * 2 * price
        cost_cache[network.network] = (time.monotonic(), floor)
        return floor

    def cost_learned_from_history(self) -> bool:
        return True

    def settlement_cost(self, terms: Terms, most: int) -> int:
        return most  # gas is known only once mined

    spend_kind = "gas"

    def load_relay_keys(self, network: Network, secrets: Sequence[str]) -> RelayKeys | None:
        return relay.load_keys(network, secrets)

    def check_relay_network(self, network: Network) -> None:
        relay.check_chain_id(network)

    def submit(
        self,
        network: Network,
        claim: Claim,
        keys: RelayKeys,
        leases: Redis,
        ledger: PayeeLedger,
        before_broadcast: BeforeBroadcast,
    ) -> Submission:
        assert isinstance(keys, relay.EvmRelayKeys)
        if keys.recorded_nonce is None:  # never silently without the database's floor (a reused recorded nonce)
            raise RuntimeError(f"the relay keys of {network.network} have no recorded-nonce lookup")
        return sender.submit(network, claim, keys.accounts, leases, before_broadcast, keys.recorded_nonce)

    def watch(self, network: Network, claims: Sequence[Claim]) -> dict[str, TxStatus]:
        return watch.watch(evm_chain(network), claims)

    def wait_landed(
        self, network: Network, claim: Claim, timeout: float, rerecord: Rerecord | None = None
    ) -> TxStatus | None:
        # The process's watcher of the network: one batch per new head for every job waiting (rails/evm/pipeline.py);
        # a stuck transaction of this job's submit is replaced with higher fees meanwhile (feebump.wait_landed).
        return feebump.wait_landed(evm_chain(network), claim, timeout, rerecord)

    def wait_final(self, network: Network, status: TxStatus, timeout: float) -> bool:
        return status.block is not None and watch.wait_confirmations(evm_chain(network), status.block, timeout)

    def read_outcome(
        self,
        network: Network,
        claim: Claim,
        *,
        deadline: float | None = None,
        pins: MutableMapping[str, int] | None = None,
        with_cost: bool = True,
    ) -> ChainOutcome:
        return outcome.read_outcome(evm_chain(network), claim, deadline, pins, with_cost)

    def before_paid(self, network: Network, claim: Claim, ledger: PayeeLedger) -> bool:
        return True  # nothing to record: the token's state is the whole truth

    def probe(self, network: Network, timeout: float) -> _Probe:
        return _Probe(network, timeout)


# The one instance: the registry serves it and the stage-1 leftovers outside the rail use it, so a rail is
# one object (code may compare rails by identity).
EVM_RAIL = EvmRail()
