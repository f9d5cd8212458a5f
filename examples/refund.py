"""Refund a paid intent as the merchant: create the refund, sign it with the payout wallet, let the relay settle it.

After ``make run`` (and a payment, e.g. ``examples/agent_pay.py``) it needs no arguments: it reads
``var/demo.json`` (the service URL, the demo API key, and the demo merchant's payout wallet keys under
``merchant_wallets``) and refunds half of the newest paid intent::

    .venv/bin/python examples/refund.py [--intent-id ID] [--amount 0.50] [--reason "damaged"]

The payout wallet's key can come from the environment instead (``MERCHANT_PRIVATE_KEY``: an EVM key, or a Solana
secret key in base58); the service never sees it, only the signed authorization. Prints the refund as JSON; on
failure, the error as JSON on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from decimal import Decimal, InvalidOperation
from typing import Any

from _project import demo_settings  # first: runs the example under the project's venv
from simplejson import dumps

from payintent.client import PayIntentClient, PayIntentError


def wallet_for(network: str, demo: dict[str, Any]) -> Any:
    """The payout wallet's signer on ``network``: MERCHANT_PRIVATE_KEY, else the demo merchant's key."""
    secret = os.environ.get("MERCHANT_PRIVATE_KEY") or ((demo.get("merchant_wallets") or {}).get(network) or {}).get(
        "private_key"
    )
    if not secret:
        raise SystemExit(f"refund: no key for the payout wallet on {network}: set MERCHANT_PRIVATE_KEY")
    if network.startswith("solana:"):
        from solders.keypair import Keypair

        return Keypair.from_base58_string(secret)
    from eth_account import Account

    return Account.from_key(secret)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Refund a paid intent from the merchant's payout wallet.")
    parser.add_argument("--url", help="the service (PAYINTENT_URL; default: demo.json's)")
    parser.add_argument("--api-key", help="merchant API key (PAYINTENT_API_KEY; default: demo.json's)")
    parser.add_argument("--intent-id", help="the paid intent (default: the newest paid one)")
    parser.add_argument("--amount", help="USDC to refund (default: half of what was paid)")
    parser.add_argument("--reason", default="Refunded by examples/refund.py")
    args = parser.parse_args(argv)
    demo = demo_settings()
    url = args.url or os.environ.get("PAYINTENT_URL") or demo.get("base_url")
    api_key = args.api_key or os.environ.get("PAYINTENT_API_KEY") or demo.get("api_key")
    if not url or not api_key:
        raise SystemExit("refund: run `make run` first, or set PAYINTENT_URL and PAYINTENT_API_KEY")
    with PayIntentClient(url, api_key) as client:
        try:
            if args.intent_id:
                intent = client.get_intent(args.intent_id)
            else:
                paid = client.list_intents(status="paid", limit=1)["intents"]
                if not paid:
                    raise SystemExit("refund: no paid intent yet: pay one first (examples/agent_pay.py)")
                intent = paid[0]
            try:
                amount = (
                    Decimal(args.amount)
                    if args.amount
                    else (Decimal(intent["amount_usdc"]) / 2).quantize(Decimal("0.000001"))
                )
            except InvalidOperation:
                parser.error(f"--amount must be a decimal number, not {args.amount!r}")
            refund = client.create_refund(intent["intent_id"], amount, reason=args.reason)
            print(f"refund {refund['refund_id']}: {refund['amount_usdc']} USDC on {refund['network']} "
                  f"from {refund['pay_from']} to {refund['pay_to']}", file=sys.stderr)  # fmt: skip
            done = client.pay_refund(refund, wallet_for(refund["network"], demo))
        except PayIntentError as err:
            error = {"status": err.status, "code": err.code, "message": err.message}
            print(dumps({"success": False, "error": error}), file=sys.stderr)
            return 1
    print(dumps(done, use_decimal=True))
    return 0 if done["status"] in ("succeeded", "processing") else 1


if __name__ == "__main__":
    sys.exit(main())
