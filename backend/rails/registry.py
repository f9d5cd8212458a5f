"""The one place that maps a chain kind to its code: adding a kind adds a rail here and a folder beside it."""

from __future__ import annotations

from backend.chains.registry import Network
from backend.rails.base import Rail
from backend.rails.evm.rail import EVM_RAIL
from backend.rails.solana.rail import SOLANA_RAIL

RAILS: dict[str, Rail] = {rail.kind: rail for rail in (EVM_RAIL, SOLANA_RAIL)}


def rail_of_kind(kind: str) -> Rail:
    """The rail of a chain kind (``Network.kind``); KeyError for a kind no rail serves."""
    return RAILS[kind]


def rail_for(network: Network) -> Rail:
    """The rail that settles payments on ``network``."""
    return RAILS[network.kind]
