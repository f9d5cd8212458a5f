"""Solana JSON-RPC access for the API, relayer and reconciler (standard methods only).

The same code talks to the local devnet RPC (``devnet/solana_rpc.py``), a ``solana-test-validator``
or Solana devnet by URL. Errors become :class:`SolanaRpcError` (whose text never holds the URL).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import requests
from requests.adapters import HTTPAdapter

from backend.config import MAX_RELAYER_THREADS
from backend.errors import ChainUnavailable
from payintent import jsonlimits

if TYPE_CHECKING:
    from backend.chains.registry import Network

_ids = itertools.count(1)


class SolanaRpcError(RuntimeError):
    """The RPC could not be reached or answered with an error (``code``/``data`` as the node sent them)."""

    def __init__(self, message: str, code: int | None = None, data: Any = None, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.data = data
        self.unreachable = unreachable  # a timeout or a failed connection: the RPC, not the request, is in trouble


@dataclass(frozen=True)
class Blockhash:
    blockhash: str
    last_valid_block_height: int


@dataclass(frozen=True)
class Simulation:
    err: Any
    logs: list[str]
    units_consumed: int | None


class SolanaChain:
    def __init__(self, rpc_url: str, timeout: float = 10.0) -> None:
        self.rpc_url = rpc_url
        self.timeout = timeout
        self._session = requests.Session()
        self._session.trust_env = False
        # Kept-alive connections: one per relayer settlement thread (requests keeps 10; more are opened, and closed).
        self._session.mount("http://", HTTPAdapter(pool_maxsize=MAX_RELAYER_THREADS))
        self._session.mount("https://", HTTPAdapter(pool_maxsize=MAX_RELAYER_THREADS))
        self._rent: dict[int, int] = {}
        self._genesis: tuple[float, str] | None = None

    def call(self, method: str, params: list[Any] | None = None) -> Any:
        body = {"jsonrpc": "2.0", "id": next(_ids), "method": method, "params": params or []}
        try:
            response = self._session.post(self.rpc_url, json=body, timeout=self.timeout)
            answer = jsonlimits.loads(response.content)  # an RPC's answer nested 20,000 deep: refused, no crash
        except (requests.RequestException, ValueError) as exc:
            raise SolanaRpcError(
                f"{method}: RPC unreachable or malformed answer ({type(exc).__name__})",
                unreachable=isinstance(exc, requests.Timeout | requests.ConnectionError),
            ) from None
        if not isinstance(answer, dict):
            raise SolanaRpcError(f"{method}: malformed answer")
        if answer.get("error"):
            error = answer["error"] if isinstance(answer["error"], dict) else {"message": str(answer["error"])}
            code = error.get("code")  # an integer, per JSON-RPC; anything else is no code
            raise SolanaRpcError(
                f"{method}: {error.get('message')}", code if isinstance(code, int) else None, error.get("data")
            )
        return answer.get("result")

    GENESIS_CACHE_SECONDS = 60.0

    def genesis_hash(self) -> str:
        """The chain's genesis hash: which chain this is. Read at most once a minute: it never changes on a
        cluster, but a local ledger started again (``solana-test-validator --reset``, the devnet under a kept
        ``var/``) is a new chain with a new one."""
        if self._genesis is None or time.monotonic() - self._genesis[0] > self.GENESIS_CACHE_SECONDS:
            genesis = self.call("getGenesisHash")
            if not isinstance(genesis, str) or not genesis:
                raise SolanaRpcError("getGenesisHash: malformed answer")
            self._genesis = (time.monotonic(), genesis)
        return self._genesis[1]

    def latest_blockhash(self) -> Blockhash:
        value = self.call("getLatestBlockhash", [{"commitment": "confirmed"}])["value"]
        return Blockhash(value["blockhash"], int(value["lastValidBlockHeight"]))

    def block_height(self, commitment: str = "confirmed") -> int:
        return int(self.call("getBlockHeight", [{"commitment": commitment}]))

    def is_blockhash_valid(self, blockhash: str) -> bool:
        return bool(self.call("isBlockhashValid", [blockhash, {"commitment": "processed"}])["value"])

    def account_exists(self, address: str) -> bool:
        value = self.call("getAccountInfo", [address, {"encoding": "base64", "commitment": "confirmed"}])["value"]
        return value is not None

    def lamports(self, address: str) -> int:
        return int(self.call("getBalance", [address, {"commitment": "confirmed"}])["value"])

    def rent_exempt_minimum(self, size: int) -> int:
        """Lamports an account of ``size`` bytes must hold (what opening one costs); read once per size."""
        cached = self._rent.get(size)
        if cached is None:
            cached = self._rent[size] = int(self.call("getMinimumBalanceForRentExemption", [size]))
        return cached

    def token_balance(self, token_account: str) -> int | None:
        """Atomic units in a token account, or None when the account does not exist."""
        try:
            value = self.call("getTokenAccountBalance", [token_account, {"commitment": "confirmed"}])["value"]
        except SolanaRpcError as exc:
            if exc.code == -32602:  # the node's "could not find account" / "not a token account"
                return None
            raise
        return int(value["amount"])

    def simulate(self, tx_base64: str, *, sig_verify: bool) -> Simulation:
        options = {"encoding": "base64", "sigVerify": sig_verify, "commitment": "confirmed"}
        value = self.call("simulateTransaction", [tx_base64, options])["value"]
        return Simulation(value.get("err"), list(value.get("logs") or []), value.get("unitsConsumed"))

    def send(self, tx_base64: str) -> str:
        options = {"encoding": "base64", "skipPreflight": False, "preflightCommitment": "confirmed", "maxRetries": 0}
        return str(self.call("sendTransaction", [tx_base64, options]))

    def signature_status(self, signature: str) -> dict[str, Any] | None:
        """The node's status of a transaction signature (``err``, ``confirmationStatus``), or None if unknown."""
        statuses = self.call("getSignatureStatuses", [[signature], {"searchTransactionHistory": True}])["value"]
        return statuses[0] if statuses else None


_chains: dict[str, SolanaChain] = {}
_lock = threading.Lock()


def solana_chain(network: Network) -> SolanaChain:
    """A cached client per RPC URL; 503 CHAIN_UNAVAILABLE when the network has none."""
    if not network.rpc_url:
        raise ChainUnavailable(network.name, f"{network.name} has no RPC URL configured")
    with _lock:  # one client per URL, also when settlement threads ask at once
        chain = _chains.get(network.rpc_url)
        if chain is None:
            chain = _chains[network.rpc_url] = SolanaChain(network.rpc_url)
        return chain
