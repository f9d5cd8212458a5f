"""The dashboard's refunds: a Refund form on a paid intent's page, and the refund's page, where the merchant connects
the payout wallet in the browser (EIP-6963 / EIP-1193 on EVM, the Wallet Standard on Solana; static/dashboard/
refund.js), signs, and watches the relay settle it. The records and the payment are the API's
(``intents.refunds``, ``settlement.refunds``): the page's scripts call JSON routes here, with the session and the
CSRF token in a header.

Registered on the dashboard's blueprint (imported by ``backend.dashboard.init_app``)."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

from flask import flash, jsonify, redirect, request, url_for

from backend import appstate
from backend.dashboard import forms, security
from backend.dashboard.views import (
    app_checkout_host,
    app_registry,
    bp,
    limit_script_calls,
    login_required,
    render,
    session_merchant_id,
)
from backend.errors import DomainError
from backend.http_errors import error_response
from backend.intents import refunds as records
from backend.intents.models import REQUIRES_SIGNATURE
from backend.settlement import api as settlement_api
from backend.settlement import refunds


@bp.post("/intents/<intent_id>/refunds")
@login_required
def create_refund(intent_id: str) -> Any:
    """The intent page's Refund form: a refund waiting for the payout wallet's signature, then its page."""
    amount: Decimal | None = None
    text = (request.form.get("amount_usdc") or "").strip()
    reason = (request.form.get("reason") or "").strip()[:500] or None
    if text:
        amount = forms.usdc_text(text)
        if amount is None or amount <= 0:
            flash("Enter the refund's amount in USDC, such as 12.50 (above 0, at most 6 decimals).", "error")
            return redirect(url_for(".intent_detail", intent_id=intent_id))
    try:
        refund = refunds.create_refund(session_merchant_id(), intent_id, amount, reason, app_checkout_host())
    except DomainError as err:
        if err.http_status == 404:
            raise
        flash(err.message, "error")
        return redirect(url_for(".intent_detail", intent_id=intent_id))
    flash("Refund created: connect your payout wallet below to sign it.", "success")
    return redirect(url_for(".refund_detail", refund_id=refund.id))


@bp.get("/refunds/<refund_id:refund_id>")
@login_required
def refund_detail(refund_id: str) -> Any:
    refund = records.get_refund(session_merchant_id(), refund_id)
    shown = records.refund_to_dict(refund)
    network = app_registry().get(refund.network)
    explorer = None
    if network is not None and network.explorer_tx_url and refund.tx_hash:
        explorer = network.explorer_tx_url.replace("{tx}", refund.tx_hash)
    signer = None
    if refund.status == REQUIRES_SIGNATURE and network is not None:
        signer = {
            "refund_id": refund.id,
            "requirement": refund.requirement,
            "pay_from": refund.pay_from,
            "pay_to": refund.pay_to,  # shown on the page: the script checks the requirement names them
            "amount_atomic": str(refund.amount_atomic),
            "network": network.for_wallets(),
            "now": int(time.time()),
            "pay_url": url_for(".pay_refund", refund_id=refund.id),
            "transaction_url": url_for(".refund_transaction", refund_id=refund.id),
            "status_url": url_for(".refund_status", refund_id=refund.id),
            "csrf_token": security.csrf_token(),
        }
    return render("refund.html", refund=shown, network=network, explorer_url=explorer, signer=signer)


@bp.get("/refunds/<refund_id:refund_id>/status")
@login_required
def refund_status(refund_id: str) -> Any:
    """The refund as the API shows it (the page polls it while the refund settles)."""
    try:
        refund = records.get_refund(session_merchant_id(), refund_id)
        return jsonify({"success": True, "data": records.refund_to_dict(refund)})
    except DomainError as err:
        return error_response(err)


@bp.post("/refunds/<refund_id:refund_id>/solana-transaction")
@login_required
def refund_transaction(refund_id: str) -> Any:
    """Solana: the transaction the payout wallet signs (``POST /api/v1/refunds/{id}/solana-transaction``)."""
    try:
        limit_script_calls(session_merchant_id())
        built = refunds.prepare_refund_transaction(session_merchant_id(), refund_id, appstate.settings())
    except DomainError as err:
        return error_response(err)
    return jsonify({"success": True, "data": built})


@bp.post("/refunds/<refund_id:refund_id>/pay")
@login_required
def pay_refund(refund_id: str) -> Any:
    """The wallet's signature, as ``POST /api/v1/refunds/{id}/pay`` takes it: 200 succeeded, 202 still settling."""
    try:
        limit_script_calls(session_merchant_id())
    except DomainError as err:
        return error_response(err)
    body = request.get_json(silent=True)
    signature = body.get("payment_signature") if isinstance(body, dict) else None
    if not isinstance(signature, dict):
        return error_response(DomainError("INVALID_PAYLOAD", "payment_signature must be an object"))
    try:
        refund, finished = settlement_api.pay_refund(session_merchant_id(), refund_id, signature)
    except DomainError as err:
        return error_response(err)
    response = jsonify({"success": True, "data": records.refund_to_dict(refund)})
    response.status_code = 200 if finished else 202
    return response
