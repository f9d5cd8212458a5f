"""A resource server that sells one endpoint to agents over HTTP 402 (x402), paid through payintent.

After ``make run`` it needs no arguments (it reads the service URL and the demo merchant's API key
from ``var/demo.json``)::

    .venv/bin/python examples/paywalled_api.py [--port 5000] [--price 0.05]

``GET /`` is free and says what is for sale; ``GET /report`` costs ``--price`` USDC. A request
without a payment gets 402 with the requirements of a fresh intent; ``examples/agent_fetch.py``
pays it and gets the report. Settings may come from the environment instead: ``PAYINTENT_URL``,
``PAYINTENT_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

try:
    from flask import Flask, jsonify

    from payintent.client import PayIntentClient
    from payintent.paywall import Paywall
except ImportError:  # run with a Python outside the project's venv: use the venv's (`make install`)
    venv = REPO / ".venv"
    if (venv / "bin" / "python").exists() and Path(sys.prefix).resolve() != venv.resolve():
        os.execv(venv / "bin" / "python", [str(venv / "bin" / "python"), *sys.argv])
    raise


def demo_settings() -> dict[str, Any]:
    path = Path(os.environ.get("PAYINTENT_VAR_DIR") or REPO / "var") / "demo.json"
    return json.loads(path.read_text()) if path.exists() else {}


def create_app(client: PayIntentClient, price: str) -> Flask:
    app = Flask(__name__)
    paywall = Paywall(client)

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
    app = create_app(PayIntentClient(url, key), args.price)
    print(f"selling GET http://127.0.0.1:{args.port}/report for {args.price} USDC (payintent at {url})", flush=True)
    app.run(host="127.0.0.1", port=args.port, threaded=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
