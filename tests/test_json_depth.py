"""Hostile JSON nesting: the depth cap (payintent.jsonlimits), the walkers, the recursion limit, every route.

A gunicorn worker died (SIGSEGV) on a 40 KB body nested 20,000 levels deep: py_ecc had raised the recursion
limit to 100,000 and the body walker recursed off the C stack. tests/observability/test_serve_deep_json.py
shows it against a real `payintent serve`; here, in process, the pieces and each kind of route.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.checkout import services as checkout_services
from backend.http import _has_nul
from backend.jsonio import JSONParseError, JSONTooDeep, stored_loads, strict_loads
from payintent import jsonlimits
from payintent.jsonlimits import MAX_JSON_DEPTH, check_depth, exceeds_depth, iter_strings, json_depth

DEEP = 20_000


def nested_arrays(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def nested_objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def reference_depth(value: Any) -> int:
    """The depth by definition (recursive: for the shallow values hypothesis makes)."""
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    return 0


# --- the scanner -----------------------------------------------------------------------------------

tricky_text = st.text(alphabet=st.sampled_from(list('[]{}"\\:,/ab\x00\u20ac\U0001f600')), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | tricky_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(tricky_text, children, max_size=4),
    max_leaves=40,
)


@given(json_values, st.booleans())
def test_the_scanner_counts_the_depth_a_parser_sees_and_ignores_brackets_in_strings(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json_depth(text) == json_depth(text.encode()) == reference_depth(value)
    depth = reference_depth(value)
    assert exceeds_depth(text, depth) is False
    assert depth == 0 or exceeds_depth(text, depth - 1) is True


@pytest.mark.parametrize("nest", [nested_arrays, nested_objects])
def test_32_levels_pass_33_are_refused(nest):
    assert MAX_JSON_DEPTH == 32
    check_depth(nest(32))
    assert strict_loads(nest(32)) is not None
    for depth in (33, DEEP):
        with pytest.raises(jsonlimits.JSONTooDeep, match="deeper than 32 levels"):
            check_depth(nest(depth))
        with pytest.raises(JSONTooDeep, match="deeper than 32 levels"):
            strict_loads(nest(depth))


def test_brackets_inside_strings_and_escapes_do_not_count():
    assert json_depth(json.dumps(["[" * 100, {"k": "{" * 100}, '\\"[[[', "\\"])) == 2
    assert json_depth(r'["\"", [[]]]') == 3
    assert strict_loads(json.dumps({"description": "[" * 1000})) == {"description": "[" * 1000}


def test_text_that_is_not_json_cannot_hide_depth_from_the_parser():
    # Whatever the scanner makes of broken text, the parser fails before it gets deeper than the scanner counted.
    for text in ['"unterminated' + "[" * 100, "[" * 40 + '"', "\\" + "[" * 40, '"\\' + "[" * 40]:
        with pytest.raises(JSONParseError):
            strict_loads(text)
    assert json_depth("[" * 40 + '"') == 40


@pytest.mark.parametrize(
    "text",
    [b'"\\"' * 21_000, b'"' * 64_000, b"\\" * 64_000, b'\\"' * 32_000, b"[" * 65_536, b'{"a":"' * 10_000],
)
def test_the_scanner_is_linear_on_pathological_text(text):
    started = time.perf_counter()
    exceeds_depth(text)
    json_depth(text)
    assert time.perf_counter() - started < 1.0  # ~5 ms here; quadratic would be minutes


# --- the walkers and the recursion limit -----------------------------------------------------------


def deep_value(depth: int, leaf: Any) -> Any:
    value = leaf
    for n in range(depth):
        value = [value] if n % 2 else {"k": value}
    return value


def test_walkers_do_not_recurse():
    value = deep_value(200_000, "bad\x00")
    assert _has_nul(value) and list(iter_strings(value)).count("k") == 100_000
    assert not _has_nul(deep_value(200_000, "fine"))
    assert _has_nul({"key\x00": 1}) and sorted(iter_strings({"a": ["b", {"c": "d"}], "e": 1})) == list("abcde")


def test_rows_we_stored_are_read_without_the_cap_and_without_a_crash():
    assert stored_loads(nested_arrays(40)) is not None
    with pytest.raises(JSONParseError):
        stored_loads(nested_arrays(DEEP))  # RecursionError at CPython's limit, not a segfault


@pytest.mark.parametrize(
    "imports",
    [
        "import backend.cli; import eth_account, web3, py_ecc",  # api, worker, relayer and CLI start here
        "import payintent.x402; import eth_account, web3",  # an agent or paywall using the library
        "import eth_account, web3; import payintent",  # py_ecc in first: the limit it set is undone
        "import eth_account; import backend.app, backend.rails.evm.relay",
    ],
)
def test_the_recursion_limit_py_ecc_raises_is_restored(imports):
    code = f"import sys; {imports}; print(sys.getrecursionlimit())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1000"


def test_the_recursion_limit_is_the_one_cpython_starts_with():
    assert sys.getrecursionlimit() == jsonlimits.DEFAULT_RECURSION_LIMIT == 1000


# --- every route that reads a JSON body ------------------------------------------------------------

SOME_ID = str(uuid.uuid4())
JSON = {"Content-Type": "application/json"}
# (rule, method, needs the merchant's key): every route whose view reads a JSON body.
TOO_DEEP = "The request body nests arrays and objects deeper than 32 levels"
JSON_ROUTES = {
    ("/api/v1/x402/intents", "POST", True),
    ("/api/v1/x402/pay", "POST", True),
    ("/api/v1/x402/intents/<string:intent_id>/solana-transaction", "POST", True),
    ("/api/v1/webhooks", "POST", True),
    ("/api/v1/webhooks/test", "POST", True),
    ("/api/v1/payment_links", "POST", True),
    ("/api/v1/x402/intents/<intent_id:intent_id>/refunds", "POST", True),
    ("/api/v1/refunds/<refund_id:refund_id>/pay", "POST", True),
    ("/api/v1/checkout/intents/<string:intent_id>/solana-transaction", "POST", False),
    ("/api/v1/checkout/intents/<string:intent_id>/pay", "POST", False),
}


SOME_REFUND_ID = "re_" + "0" * 32  # what the refund_id converter matches


def url_of(rule: str) -> str:
    parts = rule.replace("<", ">").split(">")
    ids = [SOME_REFUND_ID if part.startswith("refund_id") else SOME_ID for part in parts]
    return "".join(ids[n] if n % 2 else part for n, part in enumerate(parts))


@pytest.mark.parametrize(("rule", "method", "keyed"), sorted(JSON_ROUTES))
def test_each_json_route_takes_32_levels_and_refuses_33(client, merchant, rule, method, keyed):
    headers = {**JSON, **(merchant.headers if keyed else {})}
    too_deep = {"code": "INVALID_JSON", "message": TOO_DEEP}
    # The deepest of each kind that fits in the 64 KB body limit: 20,000 arrays, 10,000 objects.
    for nest, deepest in ((nested_arrays, DEEP), (nested_objects, 10_000)):
        read = client.open(url_of(rule), method=method, data=nest(32), headers=headers)
        assert read.status_code == 400 and read.get_json()["error"]["code"] == "VALIDATION_ERROR"  # parsed
        for depth in (33, deepest):
            refused = client.open(url_of(rule), method=method, data=nest(depth), headers=headers)
            assert refused.status_code == 400, refused.data
            assert refused.get_json() == {"success": False, "error": too_deep}


# The x402 facilitator API reads its body itself and answers in the x402 spec's shape (``isValid``/``success``
# false, the reason), our code in ``error``: a body it parsed but cannot use is INVALID_PAYLOAD, a too deep one
# INVALID_JSON, both 400.
FACILITATOR_ROUTES = {
    ("/api/v1/x402/facilitator/verify", "POST", "isValid"),
    ("/api/v1/x402/facilitator/settle", "POST", "success"),
}


@pytest.mark.parametrize(("rule", "method", "flag"), sorted(FACILITATOR_ROUTES))
def test_the_facilitator_takes_32_levels_and_refuses_33_in_the_specs_shape(client, merchant, rule, method, flag):
    headers = {**JSON, **merchant.headers}
    for nest, deepest in ((nested_arrays, DEEP), (nested_objects, 10_000)):
        read = client.open(rule, method=method, data=nest(32), headers=headers)
        assert read.status_code == 400 and read.get_json()["error"]["code"] == "INVALID_PAYLOAD", read.data
        for depth in (33, deepest):
            refused = client.open(rule, method=method, data=nest(depth), headers=headers)
            answer = refused.get_json()
            assert refused.status_code == 400 and answer[flag] is False, refused.data
            assert answer["error"] == {"code": "INVALID_JSON", "message": TOO_DEEP}


def test_no_route_fails_on_a_deep_body_and_the_json_routes_are_all_known(app, client, merchant):
    """Every rule and method of the app, with the 20,000-deep body: never a 500; INVALID_JSON exactly where a
    view reads JSON (a new such route must join JSON_ROUTES, and so the tests above)."""
    refused = set()
    for rule in app.url_map.iter_rules():
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            answer = client.open(url_of(rule.rule), method=method, data=nested_arrays(DEEP),
                                 headers={**JSON, **merchant.headers})  # fmt: skip
            assert answer.status_code != 500, (rule.rule, method, answer.data[:300])  # /readyz: 503, no chains here
            if answer.is_json and (answer.get_json().get("error") or {}).get("code") == "INVALID_JSON":
                refused.add((rule.rule, method))
    assert refused == {(rule, method) for rule, method, _ in JSON_ROUTES | FACILITATOR_ROUTES}


def test_flask_get_json_is_capped_and_answers_the_api_error(app):
    from flask import request

    app.add_url_rule("/echo-json", "echo_json", lambda: {"got": request.get_json()}, methods=["POST"])
    client = app.test_client()
    assert client.post("/echo-json", data=nested_arrays(32), headers=JSON).status_code == 200
    for body, message in ((nested_arrays(33), "deeper than 32 levels"), (nested_arrays(DEEP), "deeper than 32"),
                          (b"{", "not valid JSON")):  # fmt: skip
        answer = client.post("/echo-json", data=body, headers=JSON)
        assert answer.status_code == 400 and answer.get_json()["error"]["code"] == "INVALID_JSON"
        assert message in answer.get_json()["error"]["message"]


def test_brackets_in_strings_are_just_text(client, merchant):
    created = client.post(
        "/api/v1/x402/intents",
        json={"amount_usdc": 1, "description": "[{" * 100, "metadata": {"note": "]]]" + "[" * 200}},
        headers=merchant.headers,
    )
    assert created.status_code == 201, created.data
    assert created.get_json()["data"]["description"] == "[{" * 100


def test_checkout_writes_are_counted_before_the_body_is_read(client, monkeypatch):
    """A bad body is a request too: it counts against the client's write limit (it used not to, being refused
    while parsing, before the view's limit ran)."""
    monkeypatch.setattr(checkout_services, "WRITES_PER_MINUTE", 3)
    url = f"/api/v1/checkout/intents/{SOME_ID}/pay"
    codes = [client.post(url, data=body, headers=JSON).status_code for body in (b"{", nested_arrays(DEEP)) * 2]
    assert codes == [400, 400, 400, 429]
