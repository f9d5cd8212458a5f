"""The one place that maps a chain kind to its code: adding a kind adds a rail here and a folder beside it."""

from __future__ import annotations

from backend.chains.registry import Network
from backend.rails.base import Rail
from backend.rails.evm.rail import EvmRail
from backend.rails.solana.rail import SolanaRail

RAILS: dict[str, Rail] = {rail.kind: rail for rail in (EvmRail(), SolanaRail())}


def rail_of_kind(kind: str) -> Rail:
    """The rail of a chain kind (``Network.kind``); KeyError for a kind no rail serves."""
    return RAILS[kind]


def rail_for(network: Network) -> Rail:
    """The rail that settles payments on ``network``."""
    return RAILS[network.kind]
