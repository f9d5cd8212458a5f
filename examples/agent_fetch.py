"""An agent buying from a paid HTTP endpoint: it follows the 402, pays within its caps, gets the resource.

After ``make run`` and ``examples/paywalled_api.py`` it needs no arguments (the buyer key and the
devnet RPC URLs come from ``var/demo.json``)::

    .venv/bin/python examples/agent_fetch.py [URL] [--max-per-call 0.10] [--max-per-session 1.00]

``BUYER_PRIVATE_KEY`` and ``PAYINTENT_RPC_URLS`` (``eip155:84532=https://...``, comma-separated)
replace the demo's. The agent signs only for Circle's USDC on the supported networks and, when the
demo's devnet is running, its TestUSDC (``allowed_assets``). It prints the resource, then a
one-line JSON summary of the payment; exit status 1 when nothing was bought (refused, over a cap,
or an error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from _project import demo_settings  # first: runs the example under the project's venv

from payintent.agent import KNOWN_USDC, PayingAgent, PaymentRequiredError


def settings() -> dict[str, Any]:
    demo = demo_settings()
    key = os.environ.get("BUYER_PRIVATE_KEY") or (demo.get("buyers") or [{}])[0].get("private_key")
    rpc_urls = {network: chain["rpc_url"] for network, chain in (demo.get("networks") or {}).items()}
    allowed = {network: list(assets) for network, assets in KNOWN_USDC.items()}
    for network, chain in (demo.get("networks") or {}).items():  # the devnet's TestUSDC, on the devnet only
        allowed.setdefault(network, []).append(chain["usdc_address"])
    for item in filter(None, (os.environ.get("PAYINTENT_RPC_URLS") or "").split(",")):
        network, _, url = item.strip().partition("=")
        rpc_urls[network] = url
    if not key:
        raise SystemExit("agent_fetch: run `make run` first, or set BUYER_PRIVATE_KEY and PAYINTENT_RPC_URLS")
    return {"private_key": key, "rpc_urls": rpc_urls, "allowed_assets": allowed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GET a paid URL, paying its HTTP 402 within caps.")
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:5000/report")
    parser.add_argument("--max-per-call", default="0.10", help="USDC this call may cost at most (default 0.10)")
    parser.add_argument("--max-per-session", default="1.00", help="USDC the whole run may spend (default 1.00)")
    args = parser.parse_args(argv)
    found = settings()
    agent = PayingAgent(
        found["private_key"],
        rpc_urls=found["rpc_urls"],
        allowed_assets=found["allowed_assets"],
        max_per_call=args.max_per_call,
        max_per_session=args.max_per_session,
    )
    try:
        response = agent.get(args.url)
    except PaymentRequiredError as err:
        print(json.dumps({"success": False, "error": str(err)}), file=sys.stderr)
        return 1
    print(response.text.strip())
    payment = getattr(response, "payment", None)
    summary = {"status": response.status_code, "paid": payment, "spent_usdc": str(agent.spent_usdc)}
    print(json.dumps(summary))
    return 0 if response.ok else 1


if __name__ == "__main__":
    sys.exit(main())
