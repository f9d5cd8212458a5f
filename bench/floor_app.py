"""The floor for bench/api.py on PostgreSQL: the API's get, list and create done with the least code.

Flask and raw psycopg2 (one autocommit connection per worker, opened at start), the same SQL as the API
(the key's check joined to the intent or to the wallets, one INSERT), the same answers' shape, but none of
the service: no validation beyond the amount, no rate limits, no pool, no ORM, no logging or metrics, no
security headers. What the API cannot beat on this machine: run it as ``python -m bench.api --engines
postgresql --app "floor_app:create_app()"`` and compare its shares of bare with the API's, measured the same
hour. Not a server to deploy.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg2
from flask import Flask, Response, request

INTENTS = "/api/v1/x402/intents"
COLUMNS = ("id", "status", "amount_atomic", "order_id", "description", "metadata", "created_at", "expires_at")
KEY = "FROM api_keys {join} WHERE api_keys.key_hash = %(key_hash)s AND api_keys.revoked_at IS NULL"
GET = (
    "SELECT api_keys.merchant_id, "
    + ", ".join(f"intents.{c}" for c in COLUMNS)
    + " "
    + KEY.format(join="LEFT JOIN intents ON intents.id = %(id)s AND intents.merchant_id = api_keys.merchant_id")
)
WALLETS = "SELECT api_keys.merchant_id, wallets.network, wallets.address " + KEY.format(
    join="LEFT JOIN wallets ON wallets.merchant_id = api_keys.merchant_id"
)
LIST = (
    "SELECT " + ", ".join(COLUMNS) + ", count(*) OVER () FROM intents WHERE merchant_id = %(merchant)s"
    " ORDER BY created_at DESC, id DESC LIMIT 20"
)
INSERT = ("INSERT INTO intents (id, merchant_id, status, amount_atomic, order_id, description, metadata,"
          " payment_requirements, created_at, updated_at, expires_at) VALUES (%(id)s, %(merchant)s, 'pending',"
          " %(amount)s, %(order_id)s, %(description)s, %(metadata)s, %(requirements)s, %(now)s, %(now)s,"
          " %(expires)s)")  # fmt: skip


def _answer(status: int, body: Any) -> Response:
    return Response(json.dumps(body, default=str, separators=(",", ":")), status, mimetype="application/json")


def _intent(row: tuple[Any, ...]) -> dict[str, Any]:
    intent = dict(zip(COLUMNS, row, strict=False))
    intent["amount_usdc"] = str(Decimal(intent.pop("amount_atomic")) / 1_000_000)
    return intent


def create_app() -> Flask:
    app = Flask(__name__)
    url = os.environ["DATABASE_URL"].replace("postgresql+psycopg2://", "postgresql://", 1)
    state: dict[str, Any] = {}

    def cursor() -> Any:
        if "connection" not in state:  # opened in the worker (gunicorn forks after importing the app)
            state["connection"] = psycopg2.connect(url)
            state["connection"].autocommit = True
        return state["connection"].cursor()

    def key_hash() -> str:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        return hashlib.sha256(token.encode()).hexdigest()

    @app.get("/healthz")
    def healthz() -> Response:
        return _answer(200, {"ok": True})

    @app.get(f"{INTENTS}/<intent_id>")
    def get(intent_id: str) -> Response:
        with cursor() as cur:
            cur.execute(GET, {"key_hash": key_hash(), "id": intent_id})
            row = cur.fetchone()
        if row is None:
            return _answer(401, {"success": False})
        if row[1] is None:
            return _answer(404, {"success": False})
        return _answer(200, {"success": True, "data": _intent(row[1:])})

    @app.get(INTENTS)
    def listed() -> Response:
        with cursor() as cur:
            cur.execute(WALLETS, {"key_hash": key_hash()})
            key = cur.fetchone()
            if key is None:
                return _answer(401, {"success": False})
            cur.execute(LIST, {"merchant": key[0]})
            rows = cur.fetchall()
        total = rows[0][-1] if rows else 0
        return _answer(200, {"success": True, "data": {"intents": [_intent(r[:-1]) for r in rows], "total": total}})

    @app.post(INTENTS)
    def create() -> Response:
        body = request.get_json()
        amount = Decimal(str(body["amount_usdc"]))
        with cursor() as cur:
            cur.execute(WALLETS, {"key_hash": key_hash()})
            rows = cur.fetchall()
            if not rows:
                return _answer(401, {"success": False})
            now = datetime.now(UTC)
            intent_id = str(uuid.uuid4())
            requirements = [{"network": network, "payTo": address, "maxAmountRequired": str(int(amount * 10**6))}
                            for _, network, address in rows]  # fmt: skip
            values = {"id": intent_id, "merchant": rows[0][0], "amount": int(amount * 10**6),
                      "order_id": body.get("order_id"), "description": body.get("description"),
                      "metadata": json.dumps(body.get("metadata") or {}), "requirements": json.dumps(requirements),
                      "now": now, "expires": now + timedelta(minutes=30)}  # fmt: skip
            cur.execute(INSERT, values)
        return _answer(201, {"success": True, "data": {"intent_id": intent_id, "status": "pending",
                                                       "payment_requirements": requirements}})  # fmt: skip

    return app
