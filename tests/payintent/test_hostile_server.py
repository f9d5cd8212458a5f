"""A hostile server must not crash the client library: answers nested 100,000 levels deep.

The client and the agent parse answers of any size from servers they do not control. With py_ecc's
recursion limit of 100,000 (eth-account imports it) a 200 KB answer nested 100,000 deep made the JSON
parser overflow the C stack: the agent's process died (SIGSEGV). They run in a child process here, so
that such a crash fails this test rather than killing the test session.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from payintent import x402
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
