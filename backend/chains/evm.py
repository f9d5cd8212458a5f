"""Read-only access to an EVM chain's USDC (the API and worker hold no keys; the relayer signs)."""

from __future__ import annotations

import threading
from typing import Any

import requests
from eth_utils import keccak, to_checksum_address
from web3 import Web3
from web3.types import RPCEndpoint

from backend.chains.registry import Network

RPC_TIMEOUT_SECONDS = 10

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
            request_kwargs={"timeout": RPC_TIMEOUT_SECONDS},
            session=session,
            # web3 asks eth_chainId before every call; a chain id never changes, so ask once.
            cache_allowed_requests=True,
            cacheable_requests={RPCEndpoint("eth_chainId")},
        )
        self.w3 = Web3(provider)
        self.token = self.w3.eth.contract(address=to_checksum_address(network.usdc_address), abi=USDC_ABI)

    def balance_of(self, address: str) -> int:
        return int(self.token.functions.balanceOf(to_checksum_address(address)).call())

    def authorization_state(self, authorizer: str, nonce: bytes) -> bool:
        return bool(self.token.functions.authorizationState(to_checksum_address(authorizer), nonce).call())

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

    def authorization_log(self, authorizer: str, nonce: bytes, from_block: int) -> tuple[str, str, int] | None:
        """(topic, tx hash, block) of the AuthorizationUsed/Canceled event for this authorization, if any."""
        topics = [
            [AUTHORIZATION_USED_TOPIC, AUTHORIZATION_CANCELED_TOPIC],
            "0x" + bytes(12).hex() + to_checksum_address(authorizer)[2:].lower(),
            "0x" + nonce.hex(),
        ]
        logs = self.w3.eth.get_logs(
            {"address": self.token.address, "fromBlock": max(from_block, 0), "toBlock": "latest", "topics": topics}
        )
        if not logs:
            return None
        first = logs[0]
        topic = first["topics"][0]
        return ("0x" + bytes(topic).hex(), "0x" + bytes(first["transactionHash"]).hex(), int(first["blockNumber"]))

    def receipt(self, tx_hash: str) -> dict[str, Any] | None:
        from web3.exceptions import TransactionNotFound

        try:
            return dict(self.w3.eth.get_transaction_receipt(tx_hash))
        except TransactionNotFound:
            return None


_chains: dict[Network, EvmChain] = {}
_lock = threading.Lock()


def evm_chain(network: Network) -> EvmChain:
    """A cached client per network configuration (its RPC URL, its confirmations, ...)."""
    with _lock:
        chain = _chains.get(network)
        if chain is None:
            chain = _chains[network] = EvmChain(network)
        return chain
