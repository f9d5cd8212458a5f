"""Pay a payment intent as an agent: create it, pick the chain holding USDC, sign, settle.

After ``make run`` it needs no arguments: it reads ``var/demo.json`` (the service URL, the demo
API key, the devnet RPC URLs and the funded demo buyer keys) and pays with the first buyer::

    .venv/bin/python examples/agent_pay.py [--amount 1.00] [--order-id agent-42]

Anything can be given instead, as an option or in the environment (the signing key belongs in
the environment or a secrets manager, not on a command line)::

    PAYINTENT_URL=http://127.0.0.1:8000 PAYINTENT_API_KEY=sk_test_... BUYER_PRIVATE_KEY=0x... \\
    PAYINTENT_RPC_URLS='eip155:84532=https://sepolia.base.org' .venv/bin/python examples/agent_pay.py

It prints the settlement's ``tx_hash`` and then a one-line JSON summary; on failure, the error
as JSON on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from _project import demo_file  # first: runs the example under the project's venv
from eth_account import Account
from simplejson import dumps, loads

from payintent.client import PayIntentClient, PayIntentError


def parse_rpc_urls(items: list[str]) -> dict[str, str]:
    """``network=url`` items (also comma-separated) as a dict; the network is everything before the '='."""
    urls: dict[str, str] = {}
    for item in (part.strip() for entry in items for part in entry.split(",")):
        if not item:
            continue
        network, sep, url = item.partition("=")
        if not sep or not network.startswith("eip155:") or not url:
            raise SystemExit(f"agent_pay: bad RPC URL {item!r}: expected eip155:<chain id>=<url>")
        urls[network] = url
    return urls


def settings(args: argparse.Namespace) -> dict[str, Any]:
    demo: dict[str, Any] = {}
    path = Path(args.demo_file) if args.demo_file else demo_file()
    if path.exists():
        demo = loads(path.read_text())
    buyers = demo.get("buyers") or [{}]
    rpc_items = args.rpc or ([os.environ["PAYINTENT_RPC_URLS"]] if os.environ.get("PAYINTENT_RPC_URLS") else [])
    found = {
        "url": args.url or os.environ.get("PAYINTENT_URL") or demo.get("base_url"),
        "api_key": args.api_key or os.environ.get("PAYINTENT_API_KEY") or demo.get("api_key"),
        "private_key": os.environ.get("BUYER_PRIVATE_KEY") or buyers[0].get("private_key"),
        "rpc_urls": parse_rpc_urls(rpc_items)
        or {network: chain["rpc_url"] for network, chain in (demo.get("networks") or {}).items()},
    }
    extra = {"solana_buyers": demo.get("solana_buyers") or []}
    missing = [name for name, value in found.items() if not value]
    if missing:
        raise SystemExit(
            f"agent_pay: missing {', '.join(missing)}: run `make run` first (it writes {path}), "
            "or set PAYINTENT_URL, PAYINTENT_API_KEY, BUYER_PRIVATE_KEY and PAYINTENT_RPC_URLS"
        )
    return found | extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Create a payment intent and pay it as an agent.")
    parser.add_argument("--url", help="the service, e.g. http://127.0.0.1:8000 (PAYINTENT_URL)")
    parser.add_argument("--api-key", help="merchant API key sk_test_... (PAYINTENT_API_KEY)")
    parser.add_argument("--rpc", action="append", metavar="NETWORK=URL", help="an RPC URL per network, repeatable")
    parser.add_argument("--amount", default="1.00", help="USDC to pay (default 1.00)")
    parser.add_argument("--order-id", default=None, help="the merchant's order reference")
    parser.add_argument("--demo-file", help="default: $PAYINTENT_VAR_DIR/demo.json or var/demo.json")
    parser.add_argument(
        "--network",
        choices=("evm", "solana"),
        default="evm",
        help="pay with an EVM key (the chain holding its USDC is chosen at run time) or a Solana keypair "
        "(SOLANA_BUYER_SECRET_KEY, base58; default: the devnet's first Solana buyer)",
    )
    args = parser.parse_args(argv)
    try:
        amount = Decimal(args.amount)
    except InvalidOperation:
        parser.error(f"--amount must be a decimal number, not {args.amount!r}")
    found = settings(args)
    agent: Any = Account.from_key(found["private_key"])
    if args.network == "solana":
        from solders.keypair import Keypair

        secret = os.environ.get("SOLANA_BUYER_SECRET_KEY") or next(
            (b["secret_key"] for b in found.get("solana_buyers") or []), None
        )
        if not secret:
            raise SystemExit("agent_pay: no Solana buyer: run `make run` first or set SOLANA_BUYER_SECRET_KEY")
        agent = Keypair.from_base58_string(secret)

    with PayIntentClient(found["url"], found["api_key"], rpc_urls=found["rpc_urls"]) as client:
        try:
            intent = client.create_intent(amount, order_id=args.order_id, description="Paid by an agent")
            networks = ", ".join(r["network"] for r in intent["payment_requirements"])
            print(f"intent {intent['intent_id']}: {amount} USDC, payable on {networks}", file=sys.stderr)
            payment = client.pay(intent, agent)  # EVM: picks the chain where the agent holds the USDC
            confirmed = client.get_intent(intent["intent_id"])  # what a merchant checks before fulfilling
        except PayIntentError as err:
            error = {"status": err.status, "code": err.code, "message": err.message}
            print(dumps({"success": False, "error": error}), file=sys.stderr)
            return 1
    print(f"paid on {payment['network']} by {payment['buyer_address']}: tx_hash {payment['tx_hash']}")
    summary = {**payment, "status": confirmed["status"]}
    print(dumps(summary, use_decimal=True))
    return 0 if confirmed["status"] == "paid" else 1


if __name__ == "__main__":
    sys.exit(main())
