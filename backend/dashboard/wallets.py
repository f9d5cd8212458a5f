"""The wallets page's proof of a payout wallet (``backend.merchants.proofs``): its script (static/dashboard/
wallet-proof.js) asks for the message to sign, has the connected wallet sign it, and sends the signature back. JSON
routes, with the session and the CSRF token in a header; the message waits in the session (once, 10 minutes).

Registered on the dashboard's blueprint (imported by ``backend.dashboard.init_app``)."""

from __future__ import annotations

from typing import Any

from flask import flash, jsonify, request, session

from backend.dashboard.views import (
    app_registry,
    bp,
    limit_script_calls,
    login_required,
    session_merchant_id,
)
from backend.errors import DomainError
from backend.http_errors import error_response
from backend.merchants import proofs

_PROOF = "wallet_proof"  # the session's issued challenge


def _field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value or len(value) > 200:
        raise DomainError("VALIDATION_ERROR", f"{name} is required", fields={name: ["is required"]})
    return value


@bp.post("/wallets/challenge")
@login_required
def wallet_challenge() -> Any:
    """The message the wallet signs (it names the merchant, the network and the address)."""
    body = request.get_json(silent=True)
    try:
        limit_script_calls(session_merchant_id())
        network, address = _field(body, "network"), _field(body, "address")
        issued = proofs.challenge(session_merchant_id(), network, address, app_registry())
    except DomainError as err:
        return error_response(err)
    session[_PROOF] = issued.to_session()
    return jsonify({"success": True, "data": {"message": issued.message, "address": issued.address}})


@bp.post("/wallets/prove")
@login_required
def wallet_prove() -> Any:
    """The wallet's signature of the issued message: the wallet becomes the network's payout wallet, verified."""
    body = request.get_json(silent=True)
    issued = proofs.Challenge.from_session(session.pop(_PROOF, None))  # used once, whatever the outcome
    try:
        limit_script_calls(session_merchant_id())
        wallet = proofs.prove(session_merchant_id(), issued, _field(body, "network"), _field(body, "address"),
                              _field(body, "signature"), app_registry())  # fmt: skip
    except DomainError as err:
        return error_response(err)
    network = app_registry().get(wallet.network)
    flash(f"Verified: new intents pay {wallet.address} on {network.name if network else wallet.network}, "
          "a wallet that proved it is yours.", "success")  # fmt: skip
    return jsonify({"success": True, "data": {"network": wallet.network, "address": wallet.address, "verified": True}})
