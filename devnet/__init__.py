"""The local devnet: three Anvil chains, each with a test USDC, and a local Solana RPC over LiteSVM
(``devnet.solana_rpc``) with a USDC-like SPL mint, for development and tests.

``payintent devnet up|down|status`` and ``payintent dev`` use :func:`up`, :func:`down` and
:func:`status`. State lives under ``<PAYINTENT_VAR_DIR>/devnet/``.
"""

from __future__ import annotations

from devnet.stack import (
    BUYER_USDC,
    DEFAULT_PORT_BASE,
    LOCAL_CHAINS,
    SOLANA_NETWORK,
    DevnetError,
    LocalChain,
    devnet_dir,
    down,
    free_port_base,
    status,
    up,
)

__all__ = [
    "BUYER_USDC",
    "DEFAULT_PORT_BASE",
    "LOCAL_CHAINS",
    "SOLANA_NETWORK",
    "DevnetError",
    "LocalChain",
    "devnet_dir",
    "down",
    "free_port_base",
    "status",
    "up",
]
