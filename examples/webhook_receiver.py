"""Receive payintent webhooks: verify the signature, drop duplicates, answer 200 fast, then fulfil.

Try it against the local stack. ``make run`` starts the service and writes the demo API key to
``var/demo.json`` (it also allows loopback webhook targets such as this receiver). Register an
endpoint; the response shows its ``secret`` (``whsec_...``) once::

    curl -s -X POST http://127.0.0.1:8000/api/v1/webhooks \\
      -H 'Authorization: Bearer sk_test_...' -H 'Content-Type: application/json' \\
      -d '{"url": "http://127.0.0.1:8080/webhooks", "events": ["payment.completed", "payment.expired"]}'

Start the receiver with that secret (in the environment, or ``--secret``)::

    WEBHOOK_SECRET=whsec_... .venv/bin/python examples/webhook_receiver.py [--host 127.0.0.1] [--port 8080]

and send it a simulated event (``webhook_id`` from the registration)::

    curl -s -X POST http://127.0.0.1:8000/api/v1/webhooks/test \\
      -H 'Authorization: Bearer sk_test_...' -H 'Content-Type: application/json' \\
      -d '{"webhook_id": "...", "event": "payment.completed"}'

The first line on stdout is the receiver's URL (``--port 0`` picks a free port); then one JSON line
per new event: ``{"id": ..., "event": ..., "intent_id": ...}``. Requests are logged on stderr.

What every receiver must do, and where this one does it (``receive``):

1. Verify before parsing, over the raw body bytes exactly as received: a body parsed and dumped
   again is different bytes and fails verification. Bad or missing signature: 401, nothing done.
2. Deduplicate by the envelope ``id``: a delivery is retried until it gets a 2xx, and replays
   send the same event again, so the same ``id`` can arrive more than once.
3. Answer 2xx quickly (the service gives up on an attempt after 10 s and retries later); slow
   work belongs in a job queue.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from decimal import Decimal
from typing import Any

import _project  # noqa: F401  (first: runs the example under the project's venv)
from flask import Flask, Response, request
from werkzeug.datastructures import Headers
from werkzeug.serving import make_server

from payintent.webhooks import SECRET_PREFIX, WebhookVerificationError, verify_signature, verify_standard

TOLERANCE_SECONDS = 5 * 60
STANDARD_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


class SeenEvents:
    """Event ids already accepted. In production this is a table with a unique constraint on the id::

        CREATE TABLE processed_webhook_events (event_id TEXT PRIMARY KEY, received_at TIMESTAMP NOT NULL);

    and ``add`` is ``INSERT ... ON CONFLICT (event_id) DO NOTHING`` (one row inserted: new; none:
    duplicate), in the same transaction that records the work to do (e.g. enqueues the fulfilment
    job), so that two concurrent deliveries of one event cannot both fulfil it. An in-memory set
    forgets everything on restart and is not shared between processes.
    """

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()  # the server is threaded: check-and-add must be atomic

    def add(self, event_id: str) -> bool:
        """Record ``event_id``; True if it was new, False if it had been seen already."""
        with self._lock:
            if event_id in self._ids:
                return False
            self._ids.add(event_id)
            return True


def verify(raw_body: bytes, headers: Headers, secret: str) -> None:
    """Raise WebhookVerificationError unless the delivery is authentic (and recent, if timestamped)."""
    verify_signature(raw_body, headers.get("Service-Signature"), secret)
    if any(headers.get(name) for name in STANDARD_HEADERS):  # timestamped too: also refuse stale replays
        verify_standard(raw_body, dict(headers.items()), secret, tolerance=TOLERANCE_SECONDS)


def fulfil(envelope: dict[str, Any]) -> None:
    """The merchant's business logic. Real work (mark the order paid, ship, email) goes to a job queue,
    which reads the intent from the API (``status == "paid"``) before shipping anything."""
    data = envelope.get("data") if isinstance(envelope.get("data"), dict) else {}
    line = {"id": envelope["id"], "event": envelope.get("event"), "intent_id": data.get("intent_id")}
    print(json.dumps(line), flush=True)


def create_app(secret: str) -> Flask:
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = 1024 * 1024  # envelopes are small; refuse huge bodies (413)
    seen = SeenEvents()

    def answer(payload: dict[str, Any], status: int) -> Response:
        return Response(json.dumps(payload), status, mimetype="application/json")

    @app.post("/")
    @app.post("/<path:_path>")
    def receive(_path: str = "") -> Response:
        raw_body = request.get_data(cache=False)  # the bytes as received: never request.json before verifying
        try:
            verify(raw_body, request.headers, secret)
        except WebhookVerificationError as exc:
            print(f"webhook_receiver: refused: {exc}", file=sys.stderr, flush=True)
            return answer({"error": "invalid signature"}, 401)
        try:
            envelope = json.loads(raw_body, parse_float=Decimal)  # amounts are exact decimals, keep them so
            event_id = envelope["id"]
            if not isinstance(event_id, str) or not event_id:
                raise TypeError("id is not a string")
        except (ValueError, KeyError, TypeError):  # signed but not an envelope: not from payintent as we know it
            return answer({"error": "not a webhook envelope"}, 400)
        if not seen.add(event_id):
            return answer({"duplicate": True}, 200)
        fulfil(envelope)
        return answer({"received": True}, 200)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Receive payintent webhooks: verify, deduplicate, fulfil.")
    parser.add_argument("--secret", help="the endpoint's signing secret whsec_... (default: $WEBHOOK_SECRET)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default 8080)")
    args = parser.parse_args(argv)
    secret = (args.secret or os.environ.get("WEBHOOK_SECRET") or "").strip()
    if not secret.startswith(SECRET_PREFIX) or len(secret) == len(SECRET_PREFIX):
        # Never run with an empty secret: anyone could sign with an empty key.
        parser.error("set WEBHOOK_SECRET (or --secret) to the endpoint's whsec_... secret")

    server = make_server(args.host, args.port, create_app(secret), threaded=True)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"http://{host}:{server.server_port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
