"""Read-only access to an EVM chain's USDC (the API and worker hold no keys; the relayer signs)."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import requests
from eth_typing import HexStr
from eth_utils import keccak, to_checksum_address
from web3 import Web3
from web3.exceptions import Web3RPCError
from web3.providers.rpc.utils import REQUEST_RETRY_ALLOWLIST, ExceptionRetryConfiguration
from web3.types import BlockIdentifier, RPCEndpoint

from backend.chains.http import rpc_session
from backend.chains.registry import Network

# One RPC call waits at most this long for an answer (read), and this long to connect. web3's own retry is
# limited to one more try of a refused or reset connection: by default it retries timeouts five times (a
# hung RPC then held each call a minute, and the reconcile pass with it). Callers retry at their level.
# Never eth_sendRawTransaction (in web3's default list): a broadcast from a leased relay account is tried again only
# while the lease is surely ours (``backend.rails.evm.fence.broadcast``), never by web3 after its check.
_RETRIED_METHODS = [method for method in REQUEST_RETRY_ALLOWLIST if method != "eth_sendRawTransaction"]
RPC_TIMEOUT_SECONDS = 10.0
RPC_CONNECT_TIMEOUT_SECONDS = 3.0
RPC_CONNECT_ATTEMPTS = 2
# eth_getLogs searches at most this many blocks per call (RECONCILE_LOG_BLOCK_RANGE): providers refuse wider
# ranges (often 1,000 to 10,000 blocks). A provider refusing even that is asked for halves (see authorization_log).
DEFAULT_LOG_BLOCK_RANGE = 2000
# A width learned from a range refusal is doubled again after this many windows answered in a row (up to the
# configured range): a refusal narrows the searches for a while, never for the life of the process.
LOG_RANGE_GROW_AFTER = 8
# Search cursors kept per chain client (``authorization_log``): the authorizations searched most recently.
LOG_CURSORS_KEPT = 10_000
# A search cursor never covers the newest blocks: at most up to (newest final block - this, or - the network's
# confirmations if more). An RPC's empty answer for blocks near its head is not trusted to be complete (a
# load-balanced node or a log index behind the node that answered eth_blockNumber answers "no logs", with no
# error): those blocks are searched again by the next search. 64 blocks: about 13 minutes on Ethereum, a few
# on L2s, far beyond any log index's lag; they cost at most one more eth_getLogs window per search.
LOG_CURSOR_MARGIN = 64
# What an RPC says when it refuses an eth_getLogs because of its range or the size of its answer (lowercase):
# a limit AND a subject, or a range phrase (Alchemy names no limit), and no word of a rate limit, a quota or a
# lagging node (whole words: "separate" is not "rate").
# Infura "query returned more than 10000 results", Alchemy "Log response size exceeded ... up to a 2K block
# range" and "You can make eth_getLogs requests with up to a 500 block range. ... this block range should
# work", QuickNode "eth_getLogs is limited to a 10,000 range", Ankr "block range is too wide", Chainstack
# "Block range limit exceeded", Cloudflare "Exceeded max range limit", others "exceed maximum block range: 5000".
_RANGE_LIMITS = ("limit", "exceed", "too many", "too large", "too wide", "too big", "more than", "max")
_RANGE_SUBJECTS = ("range", "block", "result", "response size", "logs")
_RANGE_PHRASE = re.compile(r"\bup to (?:a |an )?[\d,.]+\s*k?[\s-]*blocks?\b|\bblock range should work\b")
_NOT_RANGE = re.compile(
    r"\b(?:rate|rates|ratelimit\w*|rate-limit\w*|throttl\w*|too many requests|per second|quota|credits?|"
    r"capacity|daily|beyond|head|not found|timeout|timed out)\b"
)


class LogSearchIncomplete(RuntimeError):
    """A log search ran out of its time before reaching its last block (never "not found")."""

    def __init__(self, searched_to: int) -> None:
        super().__init__(f"log search stopped after block {searched_to}")
        self.searched_to = searched_to


_ADDRESS = {"type": "address"}
_UINT = {"type": "uint256"}
_BYTES32 = {"type": "bytes32"}


def _fn(
    name: str, inputs: list[tuple[str, dict[str, str]]], outputs: list[dict[str, str]], mutability: str
) -> dict[str, Any]:
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
        session = rpc_session()
        # Proxy settings from the environment are read once here, not on every call.
        session.proxies = requests.utils.get_environ_proxies(network.rpc_url)
        provider = Web3.HTTPProvider(
            network.rpc_url,
            request_kwargs={"timeout": (RPC_CONNECT_TIMEOUT_SECONDS, RPC_TIMEOUT_SECONDS)},
            session=session,
            # Not timeouts (ConnectTimeout is a ConnectionError: at most RPC_CONNECT_ATTEMPTS x 3 s).
            exception_retry_configuration=ExceptionRetryConfiguration(
                errors=(requests.ConnectionError,),
                retries=RPC_CONNECT_ATTEMPTS,
                backoff_factor=0.1,
                method_allowlist=_RETRIED_METHODS,
            ),
            # web3 asks eth_chainId before every call; a chain id never changes, so ask once.
            cache_allowed_requests=True,
            cacheable_requests={RPCEndpoint("eth_chainId")},
        )
        self.w3 = Web3(provider)
        # The eth_getLogs width this RPC answers after refusing a wider one (None: none refused lately); it grows
        # back after LOG_RANGE_GROW_AFTER answered windows.
        self.log_range_limit: int | None = None
        self._token_name: str | None = None  # read once (``domain_name``)
        self._log_answers = 0  # windows answered in a row at the learned width
        # (authorizer, nonce) -> (first, last): blocks an unfinished search searched with no match (this process).
        self._log_cursors: dict[tuple[str, bytes], tuple[int, int]] = {}
        self.token = self.w3.eth.contract(address=to_checksum_address(network.usdc_address), abi=USDC_ABI)

    def balance_of(self, address: str) -> int:
        return int(self.token.functions.balanceOf(to_checksum_address(address)).call())

    def authorization_state(self, authorizer: str, nonce: bytes, block: BlockIdentifier = "latest") -> bool:
        """Whether the nonce is used or cancelled, at ``block`` (a height read before: a lagging node
        behind a load balancer then fails the call instead of answering from an older state)."""
        call = self.token.functions.authorizationState(to_checksum_address(authorizer), nonce)
        return bool(call.call(block_identifier=block))

    def has_code(self, address: str, block: BlockIdentifier = "latest") -> bool:
        """Whether ``address`` holds code: a contract (an ERC-1271 smart wallet) or an EOA with an EIP-7702
        delegation designator (``0xef0100`` + the delegate's address). EIP-3009 then asks that code whether
        the signature is valid, and code can answer differently at each call (docs/security.md)."""
        return len(bytes(self.w3.eth.get_code(to_checksum_address(address), block))) > 0

    def token_name(self) -> str:
        return str(self.token.functions.name().call())

    def cached_token_name(self) -> str:
        """``token_name``, read from the chain once per client (a token's name does not change)."""
        if self._token_name is None:
            self._token_name = self.token_name()
        return self._token_name

    def block_number(self) -> int:
        return int(self.w3.eth.block_number)

    def latest_block(self) -> tuple[int, int]:
        """(number, timestamp) of the chain's latest block, read at once."""
        block = self.w3.eth.get_block("latest")
        return int(block["number"]), int(block["timestamp"])

    def block_timestamp(self, block: BlockIdentifier = "latest") -> int:
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
        self,
        authorizer: str,
        nonce: bytes,
        from_block: int,
        to_block: int,
        max_range: int = DEFAULT_LOG_BLOCK_RANGE,
        deadline: float | None = None,
    ) -> tuple[str, str, int] | None:
        """(topic, tx hash, block) of the first AuthorizationUsed/Canceled event for this authorization
        between ``from_block`` and ``to_block`` (a height read before), or None if the chain has none there.

        Walked forward in windows of at most ``max_range`` blocks: RPC providers refuse wider eth_getLogs
        ranges. A window refused with an answer that names a range or result limit (``is_range_limit``) is
        halved and asked again, down to one block, and the narrower width is used by later searches until
        LOG_RANGE_GROW_AFTER windows were answered in a row, then doubled again. Any other error (a rate limit,
        a 5xx, a lagging node, a timeout), and a refusal of a one-block window, raises: an error is never "no
        log", and it does not narrow the window.

        ``deadline`` (``time.monotonic()``): checked before every window after the first; past it,
        ``LogSearchIncomplete``, and the next search of this authorization resumes where this one stopped (this
        process's memory, LOG_CURSORS_KEPT authorizations): the blocks it searched with no match, but never the
        last LOG_CURSOR_MARGIN blocks before the newest final one at its ``to_block`` (or the network's
        confirmations, if more), are not searched again. A search that reaches ``to_block`` forgets its cursor:
        no match there while the caller knows the authorization is used means an answer was incomplete (a
        lagging node), so the next search starts again at ``from_block``.
        """
        topics = [[AUTHORIZATION_USED_TOPIC, AUTHORIZATION_CANCELED_TOPIC], _word(authorizer), "0x" + nonce.hex()]
        key = (to_checksum_address(authorizer), bytes(nonce))
        start = first = max(from_block, 0)
        cursor = self._log_cursors.get(key)
        if cursor is not None and cursor[0] <= start <= cursor[1] + 1:
            first, start = cursor[0], cursor[1] + 1
        # The newest block a cursor may cover: well behind the head (see LOG_CURSOR_MARGIN).
        kept_to = self.final_block(to_block) - max(LOG_CURSOR_MARGIN, self.network.confirmations)
        width = max(1, min(max_range, self.log_range_limit or max_range))
        answered = 0
        while start <= to_block:
            if deadline is not None and answered and time.monotonic() > deadline:
                raise LogSearchIncomplete(start - 1)
            end = min(start + width - 1, to_block)
            try:
                logs = self.w3.eth.get_logs(
                    {"address": self.token.address, "fromBlock": start, "toBlock": end, "topics": topics}
                )
            except (Web3RPCError, requests.HTTPError) as exc:
                if end == start or not is_range_limit(exc):
                    raise
                width = max(1, (end - start + 1) // 2)
                self.log_range_limit, self._log_answers = width, 0
                continue
            answered += 1
            width = self._answered(width, max_range)
            if logs:
                entry = logs[0]
                topic = entry["topics"][0]
                return (
                    "0x" + bytes(topic).hex(),
                    "0x" + bytes(entry["transactionHash"]).hex(),
                    int(entry["blockNumber"]),
                )
            if min(end, kept_to) >= first:
                self._remember(key, first, min(end, kept_to))
            start = end + 1
        self._log_cursors.pop(key, None)  # reached the end with no match: the next search starts again
        return None

    def _answered(self, width: int, max_range: int) -> int:
        """A window of ``width`` was answered: the width for the next one (doubled after enough answers)."""
        if self.log_range_limit is None or width >= max_range:
            return width
        self._log_answers += 1
        if self._log_answers < LOG_RANGE_GROW_AFTER:
            return width
        width = min(width * 2, max_range)
        self.log_range_limit = width if width < max_range else None
        self._log_answers = 0
        return width

    def _remember(self, key: tuple[str, bytes], first: int, last: int) -> None:
        self._log_cursors.pop(key, None)
        self._log_cursors[key] = (first, last)  # the most recent last: the oldest go first
        while len(self._log_cursors) > LOG_CURSORS_KEPT:
            del self._log_cursors[next(iter(self._log_cursors))]

    def receipt(self, tx_hash: str) -> dict[str, Any] | None:
        from web3.exceptions import TransactionNotFound

        try:
            return dict(self.w3.eth.get_transaction_receipt(HexStr(tx_hash)))
        except TransactionNotFound:
            return None


def is_range_limit(exc: Exception) -> bool:
    """Whether an eth_getLogs error is the RPC refusing the range or the size of the answer (then a narrower
    window is asked): an HTTP 413, or an answer (a JSON-RPC error, an HTTP 400's body) whose message names a
    range or result limit, or a range phrase ("up to a 500 block range", "this block range should work").
    Not a rate limit (429, "rate limit exceeded", "too many requests"), a quota, a 5xx, a lagging node ("beyond
    the head") or any other error: those end the search (the RPC is in trouble, not the window too wide)."""
    if isinstance(exc, requests.HTTPError):
        response = exc.response
        status = response.status_code if response is not None else 0
        if status == 413:
            return True
        if status != 400 or response is None:
            return False
        message = response.text[:2000]
    else:
        message = str(getattr(exc, "message", None) or exc)
    lowered = message.lower()
    if _NOT_RANGE.search(lowered):
        return False
    if _RANGE_PHRASE.search(lowered):
        return True
    return any(word in lowered for word in _RANGE_LIMITS) and any(word in lowered for word in _RANGE_SUBJECTS)


_chains: dict[Network, EvmChain] = {}
_lock = threading.Lock()


def evm_chain(network: Network) -> EvmChain:
    """A cached client per network configuration (its RPC URL, its confirmations, ...)."""
    with _lock:
        chain = _chains.get(network)
        if chain is None:
            chain = _chains[network] = EvmChain(network)
        return chain


def domain_name(network: Network) -> str:
    """The token's EIP-712 domain name: from the chains file, else read once from the chain's ``name()`` (kept with
    the network's client). Raises when the chain cannot be read (no RPC URL, RPC trouble)."""
    if network.usdc_domain_name:
        return network.usdc_domain_name
    return evm_chain(network).cached_token_name()
