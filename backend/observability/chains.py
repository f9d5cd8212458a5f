"""Probing the configured chains for /readyz and /metrics: short timeouts, answers cached per app.

A probe never raises past this module and never reports an RPC URL (it may embed a provider key):
a failure is described by the exception's type or a fixed sentence. Answers (good or bad) are
cached, so probes and scrapes cannot hammer an RPC: readiness for :data:`CHECK_TTL_SECONDS`, gas
balances for :data:`GAS_TTL_SECONDS`. Networks are probed in parallel, so a dead RPC costs one
timeout, not one per network.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from backend.chains.registry import ChainRegistry, Network
from backend.chains.solana import SolanaRpcError
from backend.rails.base import Probe
from backend.rails.base import ProbeError as ProbeError  # health.py raises it too
from backend.rails.registry import rail_for

RPC_TIMEOUT_SECONDS = 2.0
CHECK_TTL_SECONDS = 5.0
GAS_TTL_SECONDS = 30.0


@dataclass(frozen=True)
class Outcome:
    ok: bool
    ms: float
    error: str | None = None


def _client(network: Network) -> Probe:
    """One network's RPC with a short timeout (its rail's probe: the EVM chain id and balances, or Solana's health
    and balances)."""
    return rail_for(network).probe(network, RPC_TIMEOUT_SECONDS)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ProbeError | SolanaRpcError):
        return str(exc)  # fixed sentences (SolanaRpcError's never hold the URL)
    return type(exc).__name__


def relay_accounts(network: Network) -> tuple[str, ...]:
    return rail_for(network).relay_accounts(network)


class ChainProbes:
    """The probes of one app's chain registry, with their cached answers."""

    def __init__(self, registry: ChainRegistry) -> None:
        self.networks = [n for n in registry if n.rpc_url]
        self._clients: dict[str, Probe] = {}  # made on first use, not with every app
        self._cache: dict[tuple[str, str], tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def readiness(self) -> dict[str, Outcome]:
        """Each network: does its RPC answer (as that network)?"""
        checked = self._each("check", self.networks, CHECK_TTL_SECONDS)
        return {network: outcome for network, (outcome, _) in checked.items()}

    def gas_balances(self) -> dict[str, tuple[Outcome, dict[str, Decimal]]]:
        """Each network with relay accounts: (whether the RPC answered, balance per relay account)."""
        return self._each("balances", [n for n in self.networks if relay_accounts(n)], GAS_TTL_SECONDS)

    def _client(self, network_id: str) -> Probe:
        with self._lock:
            client = self._clients.get(network_id)
            if client is None:
                network = next(n for n in self.networks if n.network == network_id)
                client = self._clients[network_id] = _client(network)
            return client

    def _each(self, method: str, networks: list[Network], ttl: float) -> dict[str, tuple[Outcome, Any]]:
        """``Probe.<method>`` of each network, from the cache while fresh, else probed in parallel."""
        now = time.monotonic()
        results: dict[str, tuple[Outcome, Any]] = {}
        stale = []
        with self._lock:
            for network in networks:
                hit = self._cache.get((method, network.network))
                if hit is not None and hit[0] > now:
                    results[network.network] = hit[1]
                else:
                    stale.append(network.network)
        if stale:
            with ThreadPoolExecutor(max_workers=len(stale), thread_name_prefix="probe") as pool:
                answers = pool.map(lambda n: timed(getattr(self._client(n), method)), stale)
                fresh = dict(zip(stale, answers, strict=True))
            with self._lock:
                for network_id, answer in fresh.items():
                    self._cache[(method, network_id)] = (time.monotonic() + ttl, answer)
            results.update(fresh)
        return results


def timed(probe: Callable[[], Any]) -> tuple[Outcome, Any]:
    """Run a probe: (its outcome with the time it took, what it returned or None)."""
    start = time.monotonic()
    try:
        value = probe()
    except Exception as exc:
        return Outcome(False, round((time.monotonic() - start) * 1000, 1), _describe(exc)), None
    return Outcome(True, round((time.monotonic() - start) * 1000, 1)), value
