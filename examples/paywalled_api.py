"""A resource server that sells one endpoint to agents over HTTP 402 (x402), paid through payintent.

After ``make run`` it needs no arguments (it reads the service URL and the demo merchant's API key
from ``var/demo.json``)::

    .venv/bin/python examples/paywalled_api.py [--port 5000] [--price 0.05]

``GET /`` is free and says what is for sale; ``GET /report`` costs ``--price`` USDC. A request
without a payment gets 402 with the requirements (no intent is made until someone pays);
``examples/agent_fetch.py`` pays it (verified, served, then settled through the facilitator API: the
merchant's paid intent) and gets the report and an access token that serves it again for five
minutes. Settings may come from the environment instead: ``PAYINTENT_URL``,
``PAYINTENT_API_KEY``.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime
from typing import Any

from _project import demo_settings  # first: runs the example under the project's venv
from flask import Flask, jsonify

from payintent.client import PayIntentClient
from payintent.paywall import Paywall


def create_app(client: PayIntentClient, price: str, origin: str | None = None) -> Flask:
    app = Flask(__name__)
    paywall = Paywall(client, origin=origin)  # the origin buyers use: shown in 402s

    @app.get("/")
    def index() -> Any:
        return jsonify({"for_sale": {"GET /report": f"{price} USDC"}, "pay_with": "x402 (HTTP 402)"})

    @app.get("/report")
    @paywall.require(price, description="Today's market report")
    def report() -> Any:
        return jsonify({"report": "USDC is worth one dollar.", "generated_at": datetime.now(UTC).isoformat()})

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve one paid endpoint (GET /report) over HTTP 402.")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--price", default="0.05", help="USDC per request (default 0.05)")
    args = parser.parse_args(argv)
    demo = demo_settings()
    url = os.environ.get("PAYINTENT_URL") or demo.get("base_url")
    key = os.environ.get("PAYINTENT_API_KEY") or demo.get("api_key")
    if not url or not key:
        raise SystemExit("paywalled_api: run `make run` first, or set PAYINTENT_URL and PAYINTENT_API_KEY")
    app = create_app(PayIntentClient(url, key), args.price, origin=f"http://127.0.0.1:{args.port}")
    print(f"selling GET http://127.0.0.1:{args.port}/report for {args.price} USDC (payintent at {url})", flush=True)
    app.run(host="127.0.0.1", port=args.port, threaded=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
