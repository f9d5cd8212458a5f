"""The one place that maps a chain kind to its code: adding a kind adds a rail here and a folder beside it."""

from __future__ import annotations

from backend.chains.registry import Network
from backend.rails.base import Rail
from backend.rails.evm.rail import EVM_RAIL
from backend.rails.solana.rail import SOLANA_RAIL

RAILS: dict[str, Rail] = {rail.kind: rail for rail in (EVM_RAIL, SOLANA_RAIL)}
# The chains file gives each kind's networks ids in its own CAIP-2 namespace (eip155:<chain id>, solana:<genesis>).
_BY_NAMESPACE: dict[str, Rail] = {rail.namespace: rail for rail in RAILS.values()}


def rail_of_kind(kind: str) -> Rail:
    """The rail of a chain kind (``Network.kind``); KeyError for a kind no rail serves."""
    return RAILS[kind]


def rail_for(network: Network) -> Rail:
    """The rail that settles payments on ``network``."""
    return RAILS[network.kind]


def rail_of_network_id(network_id: str) -> Rail:
    """The rail of a CAIP-2 network id (a settlement row's ``network``), configured or not; KeyError for a namespace
    no rail serves."""
    return _BY_NAMESPACE[network_id.partition(":")[0]]
