"""A hostile server must not crash the client library: answers nested 100,000 levels deep.

The client and the agent parse answers of any size from servers they do not control. With py_ecc's
recursion limit of 100,000 (eth-account imports it) a 200 KB answer nested 100,000 deep made the JSON
parser overflow the C stack: the agent's process died (SIGSEGV). They run in a child process here, so
that such a crash fails this test rather than killing the test session.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from payintent import x402
from payintent.agent import KNOWN_USDC, PayingAgent, PaymentRequiredError
from tests.payintent.conftest import serve

DEPTH = 100_000
DEEP = b"[" * DEPTH + b"]" * DEPTH

CHILD = """
import sys
from payintent.agent import PayingAgent, PaymentRequiredError
from payintent.client import PayIntentClient, PayIntentError

base = sys.argv[1]
try:
    PayIntentClient(base, "sk_test_" + "x" * 43).get_intent("any")
except PayIntentError as exc:
    print("client", exc.status, exc.code)
agent = PayingAgent("0x" + "11" * 32)
for path in ("/report", "/report-v2"):
    try:
        agent.get(base + path)
    except PaymentRequiredError as exc:
        print("agent", path, exc)
"""


def hostile(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    path = environ["PATH_INFO"]
    if path == "/report-v2":  # a 402 whose PAYMENT-REQUIRED header nests 33 levels
        header = base64.b64encode(b"[" * 33 + b"]" * 33).decode()
        start_response("402 Payment Required", [("PAYMENT-REQUIRED", header), ("Content-Length", "0")])
        return [b""]
    status = "402 Payment Required" if path == "/report" else "200 OK"
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(DEEP)))])
    return [DEEP]


@pytest.fixture
def hostile_url() -> Iterator[str]:
    yield from serve(hostile)


def test_the_client_and_the_agent_refuse_a_deeply_nested_answer_and_live(hostile_url):
    done = subprocess.run([sys.executable, "-c", CHILD, hostile_url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("client 200 HTTP_200"), lines  # an unexpected answer, reported as such
    assert lines[1].startswith("agent /report the 402 carries no readable payment requirements"), lines
    assert "nested deeper than 32 levels" in lines[1]
    assert lines[2].startswith("agent /report-v2 the 402 carries no readable payment requirements"), lines
    assert "nested deeper than 32 levels" in lines[2]


def test_payment_headers_nested_deeper_than_32_are_refused():
    def header(depth: int) -> str:
        return base64.b64encode(json.dumps({"x402Version": 1, "accepts": ["x"]})[:-1].encode()
                                + b',"deep":' + b"[" * depth + b"]" * depth + b"}").decode()  # fmt: skip

    assert x402.decode_header(header(31))["x402Version"] == 1  # 32 levels with the enclosing object
    with pytest.raises(x402.HeaderError, match="nested deeper than 32 levels"):
        x402.decode_header(header(32))


# --- the session cap against a hostile server (second paywall review: Medium M1, Low L5, v2 accepted) ------

SEPOLIA_USDC = KNOWN_USDC["eip155:11155111"][0]


def requirement(**changes: Any) -> dict[str, Any]:
    base = {"scheme": "exact", "network": "eip155:11155111", "maxAmountRequired": "900000", "asset": SEPOLIA_USDC,
            "payTo": "0x000000000000000000000000000000000000dEaD", "maxTimeoutSeconds": 120,
            "extra": {"name": "USDC", "version": "2"}}  # fmt: skip
    return {**base, **changes}


class Scripted:
    """A resource server answering from a script: ``offer(path)`` is the 402's requirement (our header),
    ``on_payment(path, headers)`` the answer to a payment (status, headers); every payment is kept."""

    def __init__(self, offer: Any, on_payment: Any) -> None:
        self.offer, self.on_payment = offer, on_payment
        self.kept: list[dict[str, Any]] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ["PATH_INFO"]
        raw = environ.get("HTTP_X_PAYMENT") or environ.get("HTTP_PAYMENT_SIGNATURE")
        if raw:
            self.kept.append(x402.decode_header(raw))
            status, headers = self.on_payment(path, environ)
        else:
            status, headers = "402 Payment Required", self.offer(path)
        start_response(status, [("Content-Length", "2"), *headers.items()])
        return [b"{}"]


def ours(*requirements: dict[str, Any], intent_id: str = "pi_hostile") -> dict[str, str]:
    body = {"x402Version": 1, "intent_id": intent_id, "accepts": list(requirements)}
    return {"X-Payment-Required": x402.encode_header(body)}


def test_a_402_the_agent_cannot_pay_is_refused_before_signing_and_costs_nothing():
    bad = {"/negative": requirement(maxAmountRequired="-100000000"), "/fraction": requirement(maxAmountRequired="1.5"),
           "/word": requirement(maxAmountRequired="abc"), "/zero": requirement(maxAmountRequired="0"),
           "/huge": requirement(maxAmountRequired="1" + "0" * 31), "/number": requirement(maxAmountRequired=10**40),
           "/payto": requirement(payTo="not-an-address"), "/nodomain": requirement(extra={})}  # fmt: skip
    server = Scripted(lambda path: ours(bad[path]), lambda path, environ: ("200 OK", {}))
    agent = PayingAgent("0x" + "11" * 32, max_per_call="1", max_per_session="1")
    for base in serve(server):
        for path in bad:
            with pytest.raises(PaymentRequiredError):
                agent.get(base + path)  # never a ValueError, never a negative or unreleased reservation
            assert agent.spent_usdc == 0, path
    assert server.kept == []  # nothing was signed and sent


def test_retry_after_from_a_hostile_server_is_bounded():
    waits = ("Wed, 21 Oct 2015 07:28:00 GMT", "Fri, 01 Jan 2100 00:00:00 GMT", "nan", "inf", "-inf", "1e9", "-3", "x")

    def busy(path: str, environ: dict[str, Any]) -> tuple[str, dict[str, str]]:
        return "503 Service Unavailable", {"Retry-After": waits[int(path[1:])]}

    server = Scripted(lambda path: ours(requirement()), busy)
    for base in serve(server):
        for i in range(len(waits)):
            slept: list[float] = []
            agent = PayingAgent("0x" + "22" * 32, max_per_call="1", max_per_session="10", sleep=slept.append)
            answer = agent.get(f"{base}/{i}")
            assert answer.status_code == 503 and slept, waits[i]
            assert all(math.isfinite(s) and 0 <= s <= 30 for s in slept), (waits[i], slept)
    assert len({p["payload"]["nonce"] for p in server.kept}) == len(waits)  # one authorization per call, resent


def test_the_agent_answers_v2_with_the_requirement_it_signed():
    decoy = requirement(asset="0x" + "ab" * 20)  # first on the same network, an asset the agent will not pay
    accepts = x402.v2_payment_required([decoy, requirement()], "pi_v2", "http://shop/x", "x", "")

    def offer(path: str) -> dict[str, str]:
        return {"PAYMENT-REQUIRED": x402.encode_header(accepts)}

    server = Scripted(offer, lambda path, environ: ("200 OK", {}))
    for base in serve(server):
        assert PayingAgent("0x" + "33" * 32).get(f"{base}/x").status_code == 200
    (sent,) = server.kept
    assert sent["accepted"]["asset"] == SEPOLIA_USDC and sent["accepted"]["extra"]["intentId"] == "pi_v2"
