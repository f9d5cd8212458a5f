"""The HTTP session every chain client of this process sends its JSON-RPC calls through."""

from __future__ import annotations

import requests
from requests.adapters import HTTPAdapter

from backend.config import MAX_RELAYER_THREADS

# Connections kept open per RPC host. One client per network serves every thread of a gunicorn worker (WEB_THREADS,
# 32 by default) or of the relayer (RELAYER_THREADS, up to MAX_RELAYER_THREADS): with requests' default of 10, the
# calls beyond it open a connection and then throw it away ("Connection pool is full, discarding connection"), a new
# TCP and TLS handshake per call under load.
RPC_POOL_MAXSIZE = MAX_RELAYER_THREADS


def rpc_session() -> requests.Session:
    """A session that ignores proxy settings from the environment (the caller sets its own) and keeps up to
    RPC_POOL_MAXSIZE connections per host."""
    session = requests.Session()
    session.trust_env = False
    adapter = HTTPAdapter(pool_maxsize=RPC_POOL_MAXSIZE)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session
