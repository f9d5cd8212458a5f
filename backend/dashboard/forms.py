"""Form and query-string parsing for the dashboard.

Each parser returns a :class:`Form`: the submitted values (to re-render the form with) and a
message per bad field. Rules that belong to a domain are not restated here: webhook URLs and
event lists and payment links go through the API's own schemas, intent filters through the API's query schema; the
merchant services decide emails, addresses and networks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from marshmallow import ValidationError
from werkzeug.datastructures import MultiDict

from backend.events.services import EVENT_TYPES
from backend.intents.schemas import ListIntentsQuerySchema
from backend.paymentlinks.schemas import CreateLinkSchema
from backend.webhooks.schemas import CreateWebhookSchema

# The dashboard asks more of a new password than the service's floor.
MIN_PASSWORD_LENGTH = 10
MAX_PASSWORD_LENGTH = 1024
PAGE_SIZE = 20
MAX_PAGE = 100_000


@dataclass
class Form:
    values: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, name: str, message: str) -> None:
        self.errors.setdefault(name, message)


def _text(data: Mapping[str, str], name: str) -> str:
    value = data.get(name)
    return value.strip() if isinstance(value, str) else ""


def _first_message(messages: Any) -> str:
    while isinstance(messages, dict) and messages:
        messages = next(iter(messages.values()))
    if isinstance(messages, list) and messages:
        return _first_message(messages[0])
    return str(messages)


def sentence(message: str) -> str:
    """A service message as a sentence: first letter upper case (the rest untouched), final period."""
    message = message.strip()
    message = message[:1].upper() + message[1:]
    return message if message.endswith((".", "!", "?")) else message + "."


def signup_form(data: Mapping[str, str]) -> Form:
    form = Form({"email": _text(data, "email"), "name": _text(data, "name")})
    password = data.get("password") or ""
    if not form.values["email"]:
        form.error("email", "Enter your email address.")
    if len(password) < MIN_PASSWORD_LENGTH:
        form.error("password", f"Use at least {MIN_PASSWORD_LENGTH} characters.")
    elif len(password) > MAX_PASSWORD_LENGTH:
        form.error("password", f"Use at most {MAX_PASSWORD_LENGTH} characters.")
    if not form.values["name"]:
        form.error("name", "Enter your shop's name.")
    form.values["password"] = password  # never rendered back
    return form


def login_form(data: Mapping[str, str]) -> Form:
    form = Form({"email": _text(data, "email")})
    password = data.get("password") or ""
    if not form.values["email"]:
        form.error("email", "Enter your email address.")
    if not password:
        form.error("password", "Enter your password.")
    form.values["password"] = password[: MAX_PASSWORD_LENGTH + 1]  # never rendered back
    return form


def wallet_form(data: Mapping[str, str]) -> Form:
    """A pasted payout address: unverified (no wallet signed for it), so it needs the merchant's explicit word that
    it was checked (``confirm``)."""
    form = Form({"network": _text(data, "network"), "address": _text(data, "address"),
                 "confirm": _text(data, "confirm")})  # fmt: skip
    if not form.values["address"]:
        form.error("address", "Enter the wallet address that should receive payments.")
    elif form.values["confirm"] != "yes":
        form.error("address", "Confirm that you checked the pasted address: payments sent to a wrong one are lost.")
    return form


def webhook_form(data: MultiDict[str, str]) -> Form:
    """URL and event types, checked by the webhooks API's own schema."""
    events = [e for e in data.getlist("events") if isinstance(e, str)]
    form = Form({"url": _text(data, "url"), "events": events})
    if not form.values["url"]:
        form.error("url", "Enter the URL that should receive events.")
    if not events:
        form.error("events", "Choose at least one event type.")
    if form.ok:
        try:
            loaded = CreateWebhookSchema().load({"url": form.values["url"], "events": events})
        except ValidationError as exc:
            for name, messages in exc.normalized_messages().items():
                form.error(name if name in ("url", "events") else "url", sentence(_first_message(messages)))
        else:
            form.values.update(loaded)
    return form


_AMOUNT_TEXT = re.compile(r"^[0-9]{1,7}(\.[0-9]{1,6})?$")


def usdc_text(text: str) -> Decimal | None:
    """An amount of USDC as typed in a form (``12.50``, at most 6 decimals), or None if it is not one."""
    return Decimal(text) if _AMOUNT_TEXT.match(text) else None


def link_form(data: Mapping[str, str]) -> Form:
    """A payment link's amount (USDC, as typed), description and optional redirect URL, checked by the payment
    links API's own schema; values then hold what ``paymentlinks.services.NewLink`` takes."""
    form = Form({"amount_usdc": _text(data, "amount_usdc"), "description": _text(data, "description"),
                 "redirect_url": _text(data, "redirect_url")})  # fmt: skip
    if not _AMOUNT_TEXT.match(form.values["amount_usdc"]):
        form.error("amount_usdc", "Enter an amount in USDC, such as 12.50 (at most 6 decimals).")
    if not form.values["description"]:
        form.error("description", "Enter what the buyer pays for.")
    if form.ok:
        body = {"amount_usdc": Decimal(form.values["amount_usdc"]), "description": form.values["description"],
                "redirect_url": form.values["redirect_url"] or None}  # fmt: skip
        try:
            loaded = CreateLinkSchema().load(body)
        except ValidationError as exc:
            for name, messages in exc.normalized_messages().items():
                form.error(name if name in form.values else "description", sentence(_first_message(messages)))
        else:
            form.values.update(loaded)
    return form


def event_form(data: Mapping[str, str]) -> Form:
    form = Form({"event": _text(data, "event")})
    if form.values["event"] not in EVENT_TYPES:
        form.error("event", "Choose one of the event types.")
    return form


def intents_filter(args: Mapping[str, str]) -> Form:
    """``status``, ``order_id`` and ``page`` from the query string, checked by the intents API's own
    query schema; values also hold ``limit`` and ``offset``."""
    form = Form({"status": _text(args, "status"), "order_id": _text(args, "order_id"), "page": 1})
    page = page_number(args)
    if page is None:
        form.error("page", "The page number must be a whole number of 1 or more.")
        page = 1
    form.values["page"] = page
    query: dict[str, Any] = {"limit": PAGE_SIZE, "offset": (page - 1) * PAGE_SIZE}
    query.update({name: form.values[name] for name in ("status", "order_id") if form.values[name]})
    try:
        loaded = ListIntentsQuerySchema().load(query)
    except ValidationError as exc:
        friendly = {"status": "Choose a status from the list.", "order_id": "An order ID is 1 to 128 characters."}
        for name in exc.normalized_messages():
            form.error(name if name in friendly else "page", friendly.get(name, "The page number is too large."))
    else:
        form.values.update(limit=loaded["limit"], offset=loaded["offset"])
    return form


def page_number(args: Mapping[str, str]) -> int | None:
    """``page`` from a query string (default 1); None when it is not a page number."""
    text = _text(args, "page") or "1"
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_PAGE:
        return None
    return int(text)
