"""The HTTP 402 side of x402: headers, and our payment requirements in the shapes clients read.

One place for what travels in headers between a resource server (``payintent.paywall``) and
an agent (``payintent.agent``), and for how our requirements look to the public x402 clients:

- **Our form** (what ``payintent.agent`` reads first): the ``X-Payment-Required`` header, base64
  JSON ``{x402Version: 1, accepts: [requirement as the API returns it]}`` (and ``intent_id`` when the
  402 names an intent); the agent answers with ``X-Payment``: base64 JSON of the spec's
  ``payment_signature`` (plus ``intent_id`` when named, and a ``payment-identifier`` extension).
- **x402 v1** (the 402 JSON body): ``{x402Version: 1, error, accepts}`` with v1 network names
  (``base-sepolia``) where one exists; clients answer with ``X-PAYMENT``.
- **x402 v2** (the ``PAYMENT-REQUIRED`` header): ``{x402Version: 2, error, resource, accepts}``
  with CAIP-2 networks and ``amount``; clients answer with ``PAYMENT-SIGNATURE``.

The answer to a paid request carries ``X-Payment-Response`` and ``PAYMENT-RESPONSE`` (the same
base64 JSON): ``{success, transaction, network, payer}``, and ``X-Payment-Access``: an access token
(see :mod:`payintent.access`) the buyer presents again in ``X-Payment-Access`` until
``X-Payment-Access-Expires``.
Header names are case-insensitive: ``X-Payment`` and ``X-PAYMENT`` are the same header.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from typing import Any

from payintent import jsonlimits

X402_VERSION = 1
PAYMENT_REQUIRED = "X-Payment-Required"  # ours
PAYMENT = "X-Payment"  # ours and x402 v1
PAYMENT_RESPONSE = "X-Payment-Response"  # ours and x402 v1
V2_PAYMENT_REQUIRED = "PAYMENT-REQUIRED"
V2_PAYMENT = "PAYMENT-SIGNATURE"
V2_PAYMENT_RESPONSE = "PAYMENT-RESPONSE"
PAYMENT_ACCESS = "X-Payment-Access"  # ours: the access token, in answers and in requests
PAYMENT_ACCESS_EXPIRES = "X-Payment-Access-Expires"  # ours: the token's expiry, unix seconds
MAX_HEADER_BYTES = 16 * 1024

# x402 v1 clients name networks instead of using CAIP-2 ids: the names the public x402 libraries
# (PyPI x402 2.25, npm @x402/evm and x402 1.x) use, by CAIP-2 id. Only names the libraries agree on
# (they differ for a few chains, which are left out: a chains file can name them). Arc Testnet
# (eip155:5042002) has no v1 name there. The server's chain registry starts from this table.
V1_NETWORK_NAMES: dict[str, str] = {
    "eip155:1": "ethereum",
    "eip155:11155111": "sepolia",  # npm only; the PyPI library signs v1 on it under no name
    "eip155:8453": "base",
    "eip155:84532": "base-sepolia",
    "eip155:137": "polygon",
    "eip155:80002": "polygon-amoy",
    "eip155:43114": "avalanche",
    "eip155:43113": "avalanche-fuji",
    "eip155:2741": "abstract",
    "eip155:11124": "abstract-testnet",
    "eip155:4689": "iotex",
    "eip155:1329": "sei",
    "eip155:1328": "sei-testnet",
    "eip155:3338": "peaq",
    "eip155:4326": "megaeth",
    "eip155:143": "monad",
    "eip155:10143": "monad-testnet",
    "eip155:988": "stable",
    "eip155:2201": "stable-testnet",
    "eip155:42220": "celo",
    "eip155:14": "flare",
    "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp": "solana",
    "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1": "solana-devnet",
    "solana:4uhcVJyU9pJkvQyS88uRDiswHXSCkY3z": "solana-testnet",
}
CAIP2_BY_V1_NAME = {name: caip2 for caip2, name in V1_NETWORK_NAMES.items()}


class HeaderError(ValueError):
    """A payment header that is not base64 JSON of an object."""


def encode_header(value: Mapping[str, Any]) -> str:
    """Base64 (standard alphabet, padded) of compact UTF-8 JSON, as x402 headers carry it."""
    return base64.b64encode(json.dumps(value, separators=(",", ":")).encode()).decode("ascii")


def decode_header(text: str | None) -> dict[str, Any]:
    """The JSON object in a payment header; :class:`HeaderError` when it is not one."""
    if not text:
        raise HeaderError("the header is empty")
    if len(text) > MAX_HEADER_BYTES:
        raise HeaderError("the header is too long")
    try:
        raw = base64.b64decode(text.strip() + "=" * (-len(text.strip()) % 4), validate=True)
        value = jsonlimits.loads(raw.decode("utf-8"))
    except jsonlimits.JSONTooDeep as exc:
        raise HeaderError(f"the header's JSON has {exc}") from None
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise HeaderError("the header is not base64 of JSON") from None
    if not isinstance(value, dict):
        raise HeaderError("the header's JSON is not an object")
    return value


def v1_network(network: str) -> str:
    """The v1 name of a CAIP-2 network (``eip155:84532`` → ``base-sepolia``), or the id itself."""
    return V1_NETWORK_NAMES.get(network, network)


def caip2_network(network: str) -> str:
    """The CAIP-2 id of a v1 network name (``base-sepolia`` → ``eip155:84532``), or the id itself."""
    return CAIP2_BY_V1_NAME.get(network, network)


def v1_accepts(requirements: Sequence[Mapping[str, Any]], resource_url: str) -> list[dict[str, Any]]:
    """Our requirements as x402 v1 ``accepts`` entries: v1 network names where one exists, and the
    paid resource's URL as ``resource`` (the API's requirements name the checkout page)."""
    return [{**r, "network": v1_network(str(r["network"])), "resource": resource_url} for r in requirements]


def v2_payment_required(
    requirements: Sequence[Mapping[str, Any]], intent_id: str | None, resource_url: str, description: str, error: str
) -> dict[str, Any]:
    """The x402 v2 ``PaymentRequired`` object for our requirements (``extra.intentId`` names the intent, if any)."""
    named = {"intentId": intent_id} if intent_id else {}
    return {
        "x402Version": 2,
        "error": error,
        "resource": {"url": resource_url, "description": description, "mimeType": "application/json"},
        "accepts": [
            {
                "scheme": r["scheme"],
                "network": r["network"],
                "amount": r["maxAmountRequired"],
                "asset": r["asset"],
                "payTo": r["payTo"],
                "maxTimeoutSeconds": r["maxTimeoutSeconds"],
                "extra": {**(r.get("extra") or {}), **named},
            }
            for r in requirements
        ],
    }


def from_v2_accepts(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A v2 ``accepts`` entry in our requirement shape (``amount`` → ``maxAmountRequired``)."""
    requirement = {k: v for k, v in entry.items() if k != "amount"}
    requirement["maxAmountRequired"] = str(entry["amount"])
    requirement["network"] = caip2_network(str(entry["network"]))
    return requirement
