"""payintent client package: sign and pay x402 requirements, call the payintent API."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First, before anything imports eth-account: py_ecc's recursion limit is undone here (see jsonlimits).
from payintent import jsonlimits as _jsonlimits  # noqa: F401

if TYPE_CHECKING:
    from payintent.client import NoFundedNetworkError, PayIntentClient, PayIntentError, choose_requirement
    from payintent.eip3009 import sign_authorization

__all__ = ["NoFundedNetworkError", "PayIntentClient", "PayIntentError", "choose_requirement", "sign_authorization"]

# Imported on first use, so that the server's processes import payintent.jsonlimits (and payintent.x402 for
# a paywall) without web3 and eth-account: a CLI command starts faster.
_LAZY = {
    "NoFundedNetworkError": "payintent.client",
    "PayIntentClient": "payintent.client",
    "PayIntentError": "payintent.client",
    "choose_requirement": "payintent.client",
    "sign_authorization": "payintent.eip3009",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'payintent' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
