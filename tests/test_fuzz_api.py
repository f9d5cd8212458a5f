"""Schemathesis against the app's own OpenAPI document, live over HTTP, once per engine.

The document is read from ``/api/v1/openapi.json``; the app under test is served by a real threaded
HTTP server on a local port (werkzeug's; ``make run``'s gunicorn serves the same WSGI app), and every
request goes over a socket, as `schemathesis run` sends them. Every operation in it (the keyed intents,
payments, facilitator and webhooks API and the public checkout API) gets the examples, coverage and
fuzzing phases, positive and negative, authenticated with a real merchant key, under every check
schemathesis has (``-c all``): each response must not be a 5xx, have a status the operation
documents explicitly (``default`` does not count), carry the documented content type and headers
and match the documented schema; a request the document allows must be accepted
(positive_data_acceptance) and one it rules out refused (negative_data_rejection); an undeclared
method gets 405 with an ``Allow`` that lists the path's documented methods; credentials are enforced.
The only deviations are by design, each named in ``BY_DESIGN`` with its reason.

Generated ids and payloads rarely get past the first check, so hooks mix in real ones (the
merchant's intents, webhook, delivery and payment link; correctly signed x402 payloads, v1 and v2, flat and
nested, EVM and Solana). A second test sends every single edit of those valid requests (a field
removed, retyped, or its string with a trailing newline, a space, a case change...) through the
same checks: a strict parser refuses each with a 4xx, never a 500.

Redis is real; no chain is: every RPC URL is a closed local port, so a payment that passes every
offline check answers its documented ``503 CHAIN_UNAVAILABLE`` at once. A 500 is always a failure.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from eth_account import Account
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import CHECKS as REGISTERED_CHECKS
from schemathesis.checks import (
    ignored_auth,
    load_all_checks,
    negative_data_rejection,
    positive_data_acceptance,
    use_after_free,
)
from schemathesis.core.failures import Failure
from schemathesis.core.parameters import ParameterLocation, plain_str_values
from schemathesis.errors import FailureGroup
from schemathesis.openapi.checks import IgnoredAuth
from schemathesis.specs.openapi.checks import _query_as_sent
from solders.hash import Hash
from solders.keypair import Keypair

from backend.chains.registry import ChainRegistry, default_x402_v1_name
from backend.config import Settings
from payintent import solana_tx
from payintent.eip3009 import sign_authorization
from tests.conftest import create_merchant, free_port, make_settings, truncate_all
from tests.intents.helpers import create, mark_paid
from tests.payintent.conftest import serve
from tests.webhooks.helpers import register, send_test

MAX_EXAMPLES = 40  # per operation in the fuzzing phase; the examples and coverage phases add their own
PAY_MAX_EXAMPLES = 80
FACILITATOR_MAX_EXAMPLES = 20  # its bodies nest free-form JSON values: costly to generate, one code path to reach
AUTH_FAILURES_PER_MINUTE = Settings.api_auth_failures_per_minute  # the default a deployment has
UNAVAILABLE = {"CHAIN_UNAVAILABLE"}  # the only 503 without a chain (Redis is there)
BUYER = Account.from_key("0x" + "07" * 32)
SOLANA_BUYER = Keypair.from_seed(bytes([7]) * 32)
RELAY = str(Keypair.from_seed(bytes([9]) * 32).pubkey())

# What the hooks below draw from: set by the `known` fixture for the test that is running.
_KNOWN: dict[str, Any] = {}


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> ChainRegistry:
    """The default networks (Solana with a relay) with every RPC URL on a closed local port."""
    raw = json.loads((Path(__file__).parents[1] / "backend/chains/testnets.json").read_text())
    dead = f"http://127.0.0.1:{free_port()}"
    for network in raw["networks"]:
        network["rpc_url"] = dead
        network.pop("rpc_url_env", None)
        if network["kind"] == "solana":
            network["fee_payer"] = RELAY
    path = tmp_path_factory.mktemp("chains") / "chains.json"
    path.write_text(json.dumps(raw))
    return ChainRegistry.load(str(path))


@pytest.fixture
def app(db_url: str, chains: ChainRegistry, redis_url: str) -> Iterator[Any]:
    """conftest's app, with Redis: /pay then goes past its queue check into the payload checks."""
    from backend.app import create_app
    from backend.extensions import db

    truncate_all(db_url)
    # The failed-authentication limit as deployed (conftest turns it off): schemathesis' unauthenticated cases run
    # into it, and its 429 is one of the deviations by design.
    settings = make_settings(db_url, redis_url=redis_url, api_auth_failures_per_minute=AUTH_FAILURES_PER_MINUTE)
    application = create_app(settings, chains=chains)
    with application.app_context():
        yield application
        db.session.remove()
        db.engine.dispose()


@pytest.fixture
def known(app: Any, client: Any, merchant: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Real ids of every kind (pending, paid, cancelled, another merchant's) and valid payment payloads."""
    from backend.checkout import services as checkout_services

    monkeypatch.setattr(checkout_services, "READS_PER_MINUTE", 100_000)
    monkeypatch.setattr(checkout_services, "WRITES_PER_MINUTE", 100_000)
    intent = create(client, merchant)
    pending = intent["intent_id"]
    paid = create(client, merchant)["intent_id"]
    mark_paid(paid)
    cancelled = create(client, merchant)["intent_id"]
    assert client.delete(f"/api/v1/x402/intents/{cancelled}", headers=merchant.headers).status_code == 200
    other = create(client, create_merchant(app, "other@example.com"))["intent_id"]
    webhook = register(client, merchant, "http://127.0.0.1:9/hook")["webhook_id"]
    delivery = send_test(client, merchant, webhook)["delivery_id"]
    link = {"amount_usdc": 3, "description": "fuzz"}
    link_id = client.post("/api/v1/payment_links", json=link, headers=merchant.headers).get_json()["data"]["link_id"]
    _KNOWN.update(
        intent_id=[pending, paid, cancelled, other],
        webhook_id=[webhook],
        delivery_id=[delivery],
        link_id=[link_id],
        payment_signature=valid_payment_signatures(pending, intent["payment_requirements"]),
        address=[BUYER.address, str(SOLANA_BUYER.pubkey())],
        network=[r["network"] for r in intent["payment_requirements"]],
        headers=merchant.headers,
    )
    _KNOWN["payer"] = _KNOWN["address"][1:]
    yield _KNOWN
    _KNOWN.clear()


def valid_payment_signatures(intent_id: str, requirements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each requirement, every form of a payment that passes every offline check."""
    forms: list[dict[str, Any]] = []
    for requirement in requirements:
        network = requirement["network"]
        accepted = {key: requirement[key] for key in ("scheme", "network", "asset", "payTo")}
        accepted["amount"] = requirement["maxAmountRequired"]
        if network.startswith("eip155:"):
            flat = sign_authorization(BUYER, requirement)
            authorization = {key: value for key, value in flat.items() if key != "signature"}
            nested = {"signature": flat["signature"], "authorization": authorization}
            payloads = [flat, nested]
        else:
            tx = solana_tx.build_payment(
                fee_payer=RELAY,
                payer=str(SOLANA_BUYER.pubkey()),
                mint=requirement["asset"],
                pay_to=requirement["payTo"],
                amount_atomic=int(requirement["maxAmountRequired"]),
                intent_id=intent_id,
                recent_blockhash=str(Hash(bytes([1]) * 32)),
            )
            payloads = [{"transaction": solana_tx.encode(solana_tx.sign_as(tx, SOLANA_BUYER))}]
        for payload in payloads:
            forms.append({"x402Version": 1, "scheme": "exact", "network": network, "payload": payload})
            forms.append({"x402Version": 2, "accepted": accepted, "payload": payload})
        v1_name = default_x402_v1_name(network)
        if v1_name:
            forms.append({"x402Version": 1, "scheme": "exact", "network": v1_name, "payload": payloads[0]})
    return forms


# --- single edits of a valid value ---------------------------------------------------------------

_MISSING = object()
EDITS: list[Callable[[Any], Any]] = [
    lambda v: _MISSING,
    lambda v: None,
    lambda v: True,
    lambda v: 0,
    lambda v: -1,
    lambda v: 2**256,
    lambda v: [v],
    lambda v: {"": v},
    lambda v: "",
    lambda v: f"{v}\n",
    lambda v: f"{v} ",
    lambda v: f" {v}",
    lambda v: str(v).upper(),
    lambda v: str(v).lower(),
    lambda v: str(v)[:-1],
    lambda v: f"{v}0",
    lambda v: str(v).removeprefix("0x"),
    lambda v: f"-{v}",
    lambda v: str(v).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")),
    lambda v: str(v) * 40,
    lambda v: f"{v}\ud800",  # a lone surrogate: 400 INVALID_JSON at the parse (tests/test_unicode_surrogates.py)
]


def _leaves(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(value, dict):
        yield path  # the object itself can be edited too
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    else:
        yield path


def _edited(value: Any, path: tuple[str, ...], edit: Callable[[Any], Any]) -> Any:
    if not path:
        result = edit(value)
        return None if result is _MISSING else result
    value = copy.deepcopy(value)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    result = edit(parent[path[-1]])
    if result is _MISSING:
        del parent[path[-1]]
    else:
        parent[path[-1]] = result
    return value


def single_edits(valid: Any) -> Iterator[tuple[str, Any]]:
    """Every (label, value) with one field of ``valid`` (or the whole of it) edited once."""
    for path in _leaves(valid):
        for number, edit in enumerate(EDITS):
            yield f"{'.'.join(path) or '<all>'} edit {number}", _edited(valid, path, edit)


def _mix(generated: dict[str, Any], keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """The generated object, or it with real values for the keys we know."""
    known = {key: st.sampled_from(_KNOWN[key]) for key in keys if key in generated and _KNOWN.get(key)}
    if not known:
        return st.just(generated)
    return st.one_of(st.just(generated), st.fixed_dictionaries(known).map(lambda chosen: {**generated, **chosen}))


# --- every check, and the deviations by design --------------------------------------------------


@dataclass(frozen=True)
class ByDesign:
    """A check's failure that is the API's intent: for ``check``, on operations matching ``operations`` (a regex over
    "METHOD /path"), an answer with ``status`` and one of ``codes`` (the error envelope's code; for the facilitator,
    its spec's refusal) where ``applies`` says so."""

    name: str
    check: str
    operations: str
    status: int
    codes: frozenset[str]
    reason: str
    applies: Callable[[Any, dict[str, Any]], bool] = lambda case, error: True


def _address_of_the_other_kind(case: Any, error: dict[str, Any]) -> bool:
    network, address = str(case.query.get("network")), str(case.query.get("address"))
    return network.startswith("solana:") == address.startswith("0x") and "address" in error.get("fields", {})


def _mixed_case_checksum(case: Any, error: dict[str, Any]) -> bool:
    return "EIP-55 checksum" in error["message"]


def _not_a_solana_transaction(case: Any, error: dict[str, Any]) -> bool:
    return error["message"] == "payload.transaction is not a Solana transaction"


def _refused_in_the_spec_way(case: Any, error: dict[str, Any]) -> bool:
    return error.get("refused") is True


def _range_ends_before_it_starts(case: Any, error: dict[str, Any]) -> bool:
    return error.get("fields") == {"created_from": ["must not be after created_to"]}


# What a payment's values must be for its intent, its time and its signature (the document gives their forms).
PAYMENT_CONTENT_CODES = frozenset(
    {
        *("RECIPIENT_MISMATCH", "AMOUNT_MISMATCH", "ASSET_MISMATCH", "PAYER_IS_RECIPIENT", "INVALID_SIGNATURE"),
        *("AUTHORIZATION_NOT_YET_VALID", "AUTHORIZATION_EXPIRED", "AUTHORIZATION_TOO_LONG"),
        *("INVALID_TRANSACTION", "FEE_PAYER_MISMATCH", "FEE_PAYER_MISUSED", "DISALLOWED_INSTRUCTION"),
        *("COMPUTE_BUDGET_TOO_HIGH", "BLOCKHASH_EXPIRED"),
    }
)
PAY = r"^POST /api/v1/(x402/pay|checkout/intents/\{intent_id\}/pay)$"
BY_DESIGN = [
    ByDesign(
        "payment-content",
        "positive_data_acceptance",
        PAY,
        400,
        PAYMENT_CONTENT_CODES,
        "a payment pays its intent's requirement (payTo, amount, asset), now (its validity window), signed by its "
        "payer: the document gives every field's form, no schema can say which values the intent and a signature "
        "make right",
    ),
    ByDesign(
        "solana-transaction-bytes",
        "positive_data_acceptance",
        PAY,
        400,
        frozenset({"INVALID_PAYLOAD"}),
        "payload.transaction is documented as base64 of at most a packet; which bytes are a Solana transaction "
        "no pattern can say",
        _not_a_solana_transaction,
    ),
    ByDesign(
        "intent-networks",
        "positive_data_acceptance",
        r"/(pay|balance|solana-transaction)$",
        400,
        frozenset({"UNSUPPORTED_NETWORK"}),
        "the document lists every configured network; an intent offers those its merchant has wallets on (its state)",
    ),
    ByDesign(
        "idempotency-key-reused",
        "positive_data_acceptance",
        r"^POST /api/v1/x402/intents$",
        422,
        frozenset({"IDEMPOTENCY_KEY_REUSED"}),
        "an Idempotency-Key names one request: the same key with another body is refused, whatever the body",
    ),
    ByDesign(
        "balance-address-kind",
        "positive_data_acceptance",
        r"/balance$",
        400,
        frozenset({"VALIDATION_ERROR"}),
        "address is an EVM address on an EVM network and a Solana one on Solana: two query parameters no schema "
        "ties together (each one's forms are documented)",
        _address_of_the_other_kind,
    ),
    ByDesign(
        "eip55-checksum",
        "positive_data_acceptance",
        r"/balance$",
        400,
        frozenset({"VALIDATION_ERROR"}),
        "a mixed-case EVM address must carry its EIP-55 checksum (a keccak hash: no pattern)",
        _mixed_case_checksum,
    ),
    ByDesign(
        "export-range",
        "positive_data_acceptance",
        r"^GET /api/v1/x402/intents/export\.csv$",
        400,
        frozenset({"VALIDATION_ERROR"}),
        "created_from must not be after created_to: two query parameters no schema ties together (each one's "
        "form is documented)",
        _range_ends_before_it_starts,
    ),
    ByDesign(
        "facilitator-refusals",
        "negative_data_rejection",
        r"^POST /api/v1/x402/facilitator/(verify|settle)$",
        200,
        frozenset({"*"}),
        "the x402 facilitator spec answers a payment it refuses with 200 and isValid (verify) or success (settle) "
        "false and the reason: that is its rejection (a body it cannot read at all is 400)",
        _refused_in_the_spec_way,
    ),
]


# Schemathesis' ignored_auth probes the operation without the key and with a wrong one: each probe is a failed
# authentication of 127.0.0.1, and past the limit its answer is 429 (the probe's answer is not kept: its status is
# read from the failure's message).
AUTH_FAILURES_LIMITED = ByDesign(
    "auth-failures-limited",
    "ignored_auth",
    r".",
    429,
    frozenset({"RATE_LIMITED"}),
    "past API_AUTH_FAILURES_PER_MINUTE failed authentications (30 by default) a client IP gets 429 RATE_LIMITED "
    "before its next key is even looked up: key guessing is throttled; a valid key is never limited by it",
)
BY_DESIGN.append(AUTH_FAILURES_LIMITED)


def _error_of(response: Any) -> dict[str, Any]:
    """The error envelope's error, or for the facilitator's spec-shaped answers {code, message, refused}."""
    try:
        body = json.loads(response.content)
    except ValueError:
        return {}
    if not isinstance(body, dict):
        return {}
    if "isValid" in body or ("success" in body and "errorReason" in body):
        refused = body.get("isValid", body.get("success")) is False
        return {**(body.get("error") or {}), "code": "*", "refused": refused}
    error = body.get("error")
    return error if isinstance(error, dict) and "code" in error and "message" in error else {}


def by_design(check: str, case: Any, response: Any) -> ByDesign | None:
    label, error = f"{case.operation.method.upper()} {case.operation.path}", _error_of(response)
    for rule in BY_DESIGN:
        if (
            (rule.check, rule.status) == (check, response.status_code)
            and re.search(rule.operations, label)
            and error.get("code") in rule.codes
            and rule.applies(case, error)
        ):
            return rule
    return None


def _valid_as_sent(case: Any) -> bool | None:
    """Whether the body as sent (our hooks put real values over generated ones) matches the document."""
    body = case.operation.get_body_for_media_type(case.media_type) if case.media_type else None
    try:
        return None if body is None else bool(body.is_valid(case.body))
    except ValueError:  # not a JSON value (bytes: a content-type probe)
        return None


def _query_sent(case: Any, response: Any) -> Any:
    """The query as the request carried it (a generated parameter valued [] or None is not sent at all)."""
    container = case.operation.get_parameter_set(ParameterLocation.QUERY)
    properties = container.schema.get("properties", {}) if container else {}
    sent = _query_as_sent(response, case, case.query or {}, properties)
    return case.query if sent is None else sent


def _parameters_valid_as_sent(case: Any, response: Any) -> bool:
    """Whether the path, query and header parameters as sent match the document: our hooks put real ids over
    generated ones, a query parameter without a value is not sent, and every request carries the merchant's key
    (a case generated without it is sent with it)."""
    sent = {
        ParameterLocation.PATH: case.path_parameters,
        ParameterLocation.QUERY: _query_sent(case, response),
        ParameterLocation.HEADER: {**(case.headers or {}), **_KNOWN.get("headers", {})},
    }
    for location, value in sent.items():
        container = case.operation.get_parameter_set(location)
        if not container:
            continue
        documented = {name.lower(): name for name in container.schema.get("properties", {})}
        if location == ParameterLocation.HEADER:  # names without case; undocumented headers are not the document's
            value = {documented[k.lower()]: v for k, v in (value or {}).items() if k.lower() in documented}
        if not container.get_strict_validator().is_valid(plain_str_values(dict(value or {}))):
            return False
    return True


def _mode(case: Any) -> str:
    return "" if case.meta is None else case.meta.generation.mode.value


def _positive_data_acceptance(ctx: Any, response: Any, case: Any) -> bool | None:
    if _mode(case) == "positive" and _valid_as_sent(case) is False:
        return None  # a hook made it invalid (a real network of another kind...): not a positive case any more
    try:
        return positive_data_acceptance(ctx, response, case)
    except Failure:
        if by_design("positive_data_acceptance", case, response):
            return None
        raise


def _negative_data_rejection(ctx: Any, response: Any, case: Any) -> bool | None:
    if _mode(case) == "negative" and _valid_as_sent(case) is not False and _parameters_valid_as_sent(case, response):
        return None  # a hook (or the key) replaced the generated invalid value by a real one: the request sent is valid
    try:
        return negative_data_rejection(ctx, response, case)
    except Failure:
        if by_design("negative_data_rejection", case, response):
            return None
        raise


# A stateful run (tests/test_fuzz_stateful.py) may read an intent after its DELETE: cancelling keeps the intent, and
# reading it answers 200 with status "cancelled" (the spec's cancel is a state, not a removal).
CANCELLED_STAYS_READABLE = ByDesign(
    "cancelled-intent-readable",
    "use_after_free",
    r"^GET /api/v1/x402/intents/\{intent_id\}$",
    200,
    frozenset(),
    "DELETE /api/v1/x402/intents/{id} cancels the intent: it stays readable (status cancelled), as the spec's "
    "cancel is a status, never a removal",
)
BY_DESIGN.append(CANCELLED_STAYS_READABLE)


def _use_after_free(ctx: Any, response: Any, case: Any) -> bool | None:
    try:
        return use_after_free(ctx, response, case)
    except Failure:
        label = f"{case.operation.method.upper()} {case.operation.path}"
        cancelled = response.status_code == 200 and json.loads(response.content)["data"].get("status") == "cancelled"
        if re.search(CANCELLED_STAYS_READABLE.operations, label) and cancelled:
            return None
        raise


def _ignored_auth(ctx: Any, response: Any, case: Any) -> bool | None:
    try:
        return ignored_auth(ctx, response, case)
    except IgnoredAuth as failure:
        if f"got `{AUTH_FAILURES_LIMITED.status} " in failure.message:
            return None
        raise


_positive_data_acceptance.__name__ = "positive_data_acceptance"
_negative_data_rejection.__name__ = "negative_data_rejection"
load_all_checks()
_WRAPPED = {
    "positive_data_acceptance": _positive_data_acceptance,
    "negative_data_rejection": _negative_data_rejection,
    "ignored_auth": _ignored_auth,
    "use_after_free": _use_after_free,
}
# Every check schemathesis has (`schemathesis run -c all`), the four above with the deviations by design.
CHECKS = [_WRAPPED.get(name) or REGISTERED_CHECKS.get_one(name) for name in REGISTERED_CHECKS.get_all_names()]


# --- the schema ----------------------------------------------------------------------------------


def _document_source() -> Any:
    """An app to read the document from at collection (serving it touches no database)."""
    from backend.app import create_app

    return create_app(make_settings("sqlite://"))


CONFIG = schemathesis.Config.from_dict(
    {
        # Deterministic (derandomized), nothing kept between runs.
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        # 503 is the documented answer without a chain (checked below to be exactly that).
        "checks": {"not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503"]}},
        # Payments have the most to check (forms, fields, signature): more examples there.
        "operations": [
            {"include-path-regex": "/pay$", "generation": {"max-examples": PAY_MAX_EXAMPLES}},
            {"include-path-regex": "/facilitator/", "generation": {"max-examples": FACILITATOR_MAX_EXAMPLES}},
        ],
    }
)
# The document is the same for every app. Loaded as a plain document (no app attached), its cases go over HTTP to
# the base URL given to each call: the test's app, served live.
DOCUMENT = _document_source().test_client().get("/api/v1/openapi.json").get_json()
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


@schema.hook
def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any]) -> Any:
    """Generated ids almost never exist: mix in the merchant's real ones (exact: they are ids)."""
    real = {name: _KNOWN[name] for name in path_parameters or {} if _KNOWN.get(name)}
    if not real:
        return st.just(path_parameters)
    chosen = st.fixed_dictionaries({name: st.sampled_from(ids) for name, ids in real.items()})
    return st.one_of(st.just(path_parameters), chosen.map(lambda ids: {**path_parameters, **ids}))


@schema.hook
def flatmap_query(context: Any, query: dict[str, Any]) -> Any:
    return _mix(query, ["network", "address", "webhook_id"]) if isinstance(query, dict) else st.just(query)


@schema.hook
def flatmap_body(context: Any, body: Any) -> Any:
    if not isinstance(body, dict):
        return st.just(body)
    keys = ["payment_signature", "payer", "network", "webhook_id"]
    if "intent_id" not in body or not _KNOWN.get("intent_id"):
        return _mix(body, keys)
    # /pay names its intent in the body: the pending one (its payloads are signed for it), or another.
    pending, *others = _KNOWN["intent_id"]
    real = st.sampled_from([pending] * 3 + others).map(lambda intent_id: {**body, "intent_id": intent_id})
    return st.one_of(st.just(body), real).flatmap(lambda chosen: _mix(chosen, keys))


@pytest.fixture
def api_url(app: Any) -> Iterator[str]:
    """The test's app, served over real HTTP."""
    yield from serve(app)


def _send(case: Any, api_url: str, merchant: Any) -> None:
    """Call the live API with the merchant's key; schemathesis' checks, then ours."""
    response = case.call_and_validate(base_url=api_url, headers=merchant.headers, checks=CHECKS, timeout=30)
    if case.method.upper() != case.operation.method.upper():
        # A probe with a method the path does not have: 405, except Flask's automatic OPTIONS (and HEAD of a GET).
        assert response.status_code == 405 or case.method.upper() in ("OPTIONS", "HEAD"), response.status_code
        return
    documented = case.operation.definition.raw["responses"]
    assert str(response.status_code) in documented, f"{response.status_code} is documented only by 'default'"
    if response.status_code == 503:
        assert response.json()["error"]["code"] in UNAVAILABLE, response.text


@schema.parametrize()
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # one app per operation, on purpose
def test_api_conforms_to_its_openapi_document(case: Any, api_url: str, merchant: Any, known: Any) -> None:
    _send(case, api_url, merchant)


def _valid_requests() -> Iterator[tuple[str, str, dict[str, str] | None, str, Any]]:
    """(path, method, path parameters, part, value) of requests that pass every check needing no chain."""
    pending = _KNOWN["intent_id"][0]
    signatures = _KNOWN["payment_signature"]
    evm_v1 = next(s for s in signatures if s["x402Version"] == 1 and "from" in s["payload"])
    evm_v2_nested = next(s for s in signatures if s["x402Version"] == 2 and "authorization" in s["payload"])
    solana = next(s for s in signatures if "transaction" in s["payload"])
    v1_name = next(s for s in signatures if ":" not in s.get("network", ":"))  # base-sepolia, not eip155:84532
    for signature in (evm_v1, evm_v2_nested, solana):
        yield "/api/v1/x402/pay", "POST", None, "body", {"intent_id": pending, "payment_signature": signature}
    checkout, ids = "/api/v1/checkout/intents/{intent_id}", {"intent_id": pending}
    yield f"{checkout}/pay", "POST", ids, "body", {"payment_signature": v1_name}
    for network in _KNOWN["network"]:
        address = str(SOLANA_BUYER.pubkey()) if network.startswith("solana:") else BUYER.address
        yield f"{checkout}/balance", "GET", ids, "query", {"network": network, "address": address}
    yield f"{checkout}/solana-transaction", "POST", ids, "body", {"payer": str(SOLANA_BUYER.pubkey())}


def test_every_single_edit_of_a_valid_payment_is_refused_cleanly(api_url: str, merchant: Any, known: Any) -> None:
    """Each field of a valid /pay, balance or Solana transaction request edited once (about 1,200
    requests): a 4xx or the documented 503, conforming to the document; never a 500."""
    failures, sent = [], 0
    for path, method, path_parameters, part, valid in _valid_requests():
        operation = schema[path][method]
        for label, value in [("valid", valid), *single_edits(valid)]:
            if part == "query" and not (
                isinstance(value, dict) and all(isinstance(v, str) and "\ud800" not in v for v in value.values())
            ):
                continue  # a query string holds strings only (a lone surrogate cannot even be percent-encoded)
            sent += 1
            try:
                _send(operation.Case(path_parameters=path_parameters, **{part: value}), api_url, merchant)
            except (AssertionError, FailureGroup) as exc:  # collect them all, then report
                failures.append(f"{method} {path} {part} {label}: {value!r}\n  {str(exc)[:300]}")
    assert not failures, f"{len(failures)} of {sent} requests failed:\n" + "\n".join(failures[:20])
