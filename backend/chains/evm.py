"""Read-only access to an EVM chain's USDC (the API and worker hold no keys; the relayer signs)."""

from __future__ import annotations

import threading
from typing import Any

import requests
from eth_utils import keccak, to_checksum_address
from web3 import Web3
from web3.exceptions import Web3RPCError
from web3.providers.rpc.utils import ExceptionRetryConfiguration
from web3.types import RPCEndpoint

from backend.chains.registry import Network

# One RPC call waits at most this long for an answer (read), and this long to connect. web3's own retry is
# limited to one more try of a refused or reset connection: by default it retries timeouts five times (a
# hung RPC then held each call a minute, and the reconcile pass with it). Callers retry at their level.
RPC_TIMEOUT_SECONDS = 10.0
RPC_CONNECT_TIMEOUT_SECONDS = 3.0
RPC_CONNECT_ATTEMPTS = 2
# eth_getLogs searches at most this many blocks per call (RECONCILE_LOG_BLOCK_RANGE): providers refuse wider
# ranges (often 1,000 to 10,000 blocks). A provider refusing even that is asked for halves (see authorization_log).
DEFAULT_LOG_BLOCK_RANGE = 2000

_ADDRESS = {"type": "address"}
_UINT = {"type": "uint256"}
_BYTES32 = {"type": "bytes32"}


def _fn(name: str, inputs: list[tuple[str, dict[str, str]]], outputs: list[dict[str, str]], mutability: str) -> dict:
    return {
        "type": "function",
        "name": name,
        "inputs": [{"name": n, **t} for n, t in inputs],
        "outputs": [{"name": "", **t} for t in outputs],
        "stateMutability": mutability,
    }


# The slice of FiatToken v2 (and our TestUSDC) the service uses.
USDC_ABI: list[dict[str, Any]] = [
    _fn("name", [], [{"type": "string"}], "view"),
    _fn("balanceOf", [("account", _ADDRESS)], [_UINT], "view"),
    _fn("authorizationState", [("authorizer", _ADDRESS), ("nonce", _BYTES32)], [{"type": "bool"}], "view"),
    _fn(
        "transferWithAuthorization",
        [
            ("from", _ADDRESS),
            ("to", _ADDRESS),
            ("value", _UINT),
            ("validAfter", _UINT),
            ("validBefore", _UINT),
            ("nonce", _BYTES32),
            ("v", {"type": "uint8"}),
            ("r", _BYTES32),
            ("s", _BYTES32),
        ],
        [],
        "nonpayable",
    ),
]
AUTHORIZATION_USED_TOPIC = "0x" + keccak(text="AuthorizationUsed(address,bytes32)").hex()
AUTHORIZATION_CANCELED_TOPIC = "0x" + keccak(text="AuthorizationCanceled(address,bytes32)").hex()
TRANSFER_TOPIC = "0x" + keccak(text="Transfer(address,address,uint256)").hex()


def _word(address: str) -> str:
    """An address as an indexed log topic (32 bytes, lowercase hex)."""
    return "0x" + bytes(12).hex() + to_checksum_address(address)[2:].lower()


def _hex(value: Any) -> str:
    """A log's topic or data (bytes from web3, or hex text) as lowercase 0x-hex."""
    if isinstance(value, str):
        return "0x" + value.removeprefix("0x").lower()
    return "0x" + bytes(value).hex()


def authorization_transfer(
    receipt: dict[str, Any], token: str, authorizer: str, nonce: bytes
) -> tuple[str, int] | None:
    """What the authorization ``(authorizer, nonce)`` moved in this transaction: ``(to, value)`` of the
    token's ``Transfer(authorizer, to, value)`` log right after its ``AuthorizationUsed`` log.

    EIP-3009 nonces belong to the authorizer, not to one set of terms: the same nonce may be signed
    again with another recipient or amount, and whichever executes first uses it. The token (FiatToken,
    our TestUSDC) marks the nonce used and transfers in the same call, with nothing in between, so the
    log after ``AuthorizationUsed`` is the transfer that authorization made. None if the receipt holds
    no ``AuthorizationUsed(authorizer, nonce)`` of the token, or no such transfer right after it.
    """
    logs = sorted(receipt.get("logs") or [], key=lambda entry: int(entry["logIndex"]))
    used = [AUTHORIZATION_USED_TOPIC, _word(authorizer), "0x" + nonce.hex()]
    for i, entry in enumerate(logs):
        if entry["address"].lower() != token.lower() or [_hex(t) for t in entry["topics"]] != used:
            continue
        following = logs[i + 1] if i + 1 < len(logs) else None
        if following is None or following["address"].lower() != token.lower():
            return None
        topics = [_hex(t) for t in following["topics"]]
        if int(following["logIndex"]) != int(entry["logIndex"]) + 1 or len(topics) != 3:
            return None
        if topics[0] != TRANSFER_TOPIC or topics[1] != _word(authorizer):
            return None
        value = int(_hex(following["data"]), 16) if _hex(following["data"]) != "0x" else 0
        return to_checksum_address("0x" + topics[2][-40:]), value
    return None


class EvmChain:
    def __init__(self, network: Network) -> None:
        if not network.rpc_url:
            raise ValueError(f"{network.network} has no RPC URL configured")
        self.network = network
        session = requests.Session()
        # Proxy settings from the environment are read once here, not on every call.
        session.proxies = requests.utils.get_environ_proxies(network.rpc_url)
        session.trust_env = False
        provider = Web3.HTTPProvider(
            network.rpc_url,
            request_kwargs={"timeout": (RPC_CONNECT_TIMEOUT_SECONDS, RPC_TIMEOUT_SECONDS)},
            session=session,
            # Not timeouts (ConnectTimeout is a ConnectionError: at most RPC_CONNECT_ATTEMPTS x 3 s).
            exception_retry_configuration=ExceptionRetryConfiguration(
                errors=(requests.ConnectionError,), retries=RPC_CONNECT_ATTEMPTS, backoff_factor=0.1
            ),
            # web3 asks eth_chainId before every call; a chain id never changes, so ask once.
            cache_allowed_requests=True,
            cacheable_requests={RPCEndpoint("eth_chainId")},
        )
        self.w3 = Web3(provider)
        # The widest eth_getLogs range this RPC answered after refusing a wider one (None: none refused yet).
        self.log_range_limit: int | None = None
        self.token = self.w3.eth.contract(address=to_checksum_address(network.usdc_address), abi=USDC_ABI)

    def balance_of(self, address: str) -> int:
        return int(self.token.functions.balanceOf(to_checksum_address(address)).call())

    def authorization_state(self, authorizer: str, nonce: bytes, block: int | str = "latest") -> bool:
        """Whether the nonce is used or cancelled, at ``block`` (a height read before: a lagging node
        behind a load balancer then fails the call instead of answering from an older state)."""
        call = self.token.functions.authorizationState(to_checksum_address(authorizer), nonce)
        return bool(call.call(block_identifier=block))

    def has_code(self, address: str, block: int | str = "latest") -> bool:
        """Whether ``address`` holds code: a contract (an ERC-1271 smart wallet) or an EOA with an EIP-7702
        delegation designator (``0xef0100`` + the delegate's address). EIP-3009 then asks that code whether
        the signature is valid, and code can answer differently at each call (docs/security.md)."""
        return len(bytes(self.w3.eth.get_code(to_checksum_address(address), block))) > 0

    def token_name(self) -> str:
        return str(self.token.functions.name().call())

    def block_number(self) -> int:
        return int(self.w3.eth.block_number)

    def block_timestamp(self, block: int | str = "latest") -> int:
        return int(self.w3.eth.get_block(block)["timestamp"])

    def is_final(self, block_number: int, head: int | None = None) -> bool:
        """Whether a block is buried under the network's configured confirmations.

        ``head``: the chain height to judge against, read *before* the block was looked up (a
        log or a receipt), so a reorg in between cannot make a dropped block look final.
        """
        head = self.block_number() if head is None else head
        return head - block_number + 1 >= max(self.network.confirmations, 1)

    def final_block(self, head: int) -> int:
        """The newest block that is final when the chain is at ``head`` (no reorg reaches it)."""
        return max(head - max(self.network.confirmations, 1) + 1, 0)

    def authorization_log(
        self, authorizer: str, nonce: bytes, from_block: int, to_block: int, max_range: int = DEFAULT_LOG_BLOCK_RANGE
    ) -> tuple[str, str, int] | None:
        """(topic, tx hash, block) of the first AuthorizationUsed/Canceled event for this authorization
        between ``from_block`` and ``to_block`` (a height read before), or None if the chain has none there.

        Walked forward in windows of at most ``max_range`` blocks: RPC providers refuse wider eth_getLogs
        ranges. A window the RPC refuses with an error (a JSON-RPC error, an HTTP 4xx) is halved and asked
        again, down to one block; the width that then worked is remembered for this RPC. An error on a
        one-block window, a timeout or an unreachable RPC raises: an error is never "no log". (The query
        names the authorizer and the nonce, so a provider's cap on the number of results is never reached.)
        """
        topics = [[AUTHORIZATION_USED_TOPIC, AUTHORIZATION_CANCELED_TOPIC], _word(authorizer), "0x" + nonce.hex()]
        start = max(from_block, 0)
        width = max(1, min(max_range, self.log_range_limit or max_range))
        refused = False
        while start <= to_block:
            end = min(start + width - 1, to_block)
            try:
                logs = self.w3.eth.get_logs(
                    {"address": self.token.address, "fromBlock": start, "toBlock": end, "topics": topics}
                )
            except (Web3RPCError, requests.HTTPError) as exc:
                if end == start or not _may_be_range_limit(exc):
                    raise
                width, refused = max(1, (end - start + 1) // 2), True
                continue
            if refused:  # answered after a refusal: later searches start at this width
                self.log_range_limit, refused = width, False
            if logs:
                first = logs[0]
                topic = first["topics"][0]
                return (
                    "0x" + bytes(topic).hex(),
                    "0x" + bytes(first["transactionHash"]).hex(),
                    int(first["blockNumber"]),
                )
            start = end + 1
        return None

    def receipt(self, tx_hash: str) -> dict[str, Any] | None:
        from web3.exceptions import TransactionNotFound

        try:
            return dict(self.w3.eth.get_transaction_receipt(tx_hash))
        except TransactionNotFound:
            return None


def _may_be_range_limit(exc: Exception) -> bool:
    """Whether an eth_getLogs error may be the provider refusing the range (or the size of the answer): a
    JSON-RPC error, or an HTTP 4xx (some gateways answer 400 or 413). Not a 5xx: the RPC is in trouble."""
    if isinstance(exc, requests.HTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        return 400 <= status < 500
    return True


_chains: dict[Network, EvmChain] = {}
_lock = threading.Lock()


def evm_chain(network: Network) -> EvmChain:
    """A cached client per network configuration (its RPC URL, its confirmations, ...)."""
    with _lock:
        chain = _chains.get(network)
        if chain is None:
            chain = _chains[network] = EvmChain(network)
        return chain
