"""The dashboard's payment links page: list, create and deactivate links (``backend.paymentlinks``).

Registered on the dashboard's blueprint (imported by ``backend.dashboard.init_app``)."""

from __future__ import annotations

from typing import Any

from flask import flash, redirect, request, url_for
from werkzeug.wrappers import Response

from backend.dashboard import forms
from backend.dashboard.forms import Form
from backend.dashboard.views import app_checkout_host, bp, login_required, render, session_merchant_id
from backend.paymentlinks import services as links

LINKS_SHOWN = 100  # newest first; the API lists them all


def _links_page(form: Form, status: int = 200) -> Response:
    rows, total = links.list_links(session_merchant_id(), limit=LINKS_SHOWN, offset=0)
    shown = [links.link_to_dict(row, app_checkout_host()) for row in rows]
    return render("links.html", status, links=shown, total=total, form=form)


@bp.get("/links")
@login_required
def link_list() -> Any:
    return _links_page(Form({"amount_usdc": "", "description": "", "redirect_url": ""}))


@bp.post("/links")
@login_required
def create_link() -> Any:
    form = forms.link_form(request.form)
    if not form.ok:
        return _links_page(form, 400)
    values = form.values
    link = links.create_link(
        session_merchant_id(), links.NewLink(values["amount_usdc"], values["description"], values["redirect_url"])
    )
    flash(f"Payment link created: {links.link_url(app_checkout_host(), link.id)}", "success")
    return redirect(url_for(".link_list"))


@bp.post("/links/<link_id>/deactivate")
@login_required
def deactivate_link(link_id: str) -> Any:
    link = links.deactivate_link(session_merchant_id(), link_id)
    flash(f"Link deactivated: {links.link_url(app_checkout_host(), link.id)} makes no more intents.", "success")
    return redirect(url_for(".link_list"))
