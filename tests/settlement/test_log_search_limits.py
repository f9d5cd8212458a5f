"""Review round 2, M2: a burst of transient eth_getLogs errors shrank the log window to one block for the life
of the process, and one settlement's log search ignored the chain's time in the reconcile pass.

Every JSON-RPC error and every HTTP 4xx was taken for a range limit: the window halved and the narrower width
was kept for good; each search restarted at the claim's block; ``ChainPass`` was checked only between
settlements. Now only an answer that names a range or result limit (or a 413) narrows the window, the width
grows back, a search resumes where the last one stopped (final blocks only), and the chain's time is checked
between windows (an unfinished search is NOT_FINAL: never "not found", never released).

Real Anvil chain and token, real PostgreSQL and Redis; the remote provider's answers (a rate limit, a range
limit, its latency) are simulated on the reconciler's web3 transport, as in test_log_range.py.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import requests
from eth_account import Account
from redis import Redis
from web3.exceptions import Web3RPCError

from backend import clock as clock_module
from backend.chains.evm import EvmChain, evm_chain
from backend.settlement.reconcile import reconcile
from payintent.eip3009 import sign_authorization
from tests.settlement.test_duplicate import _execute
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_payer_code import funded_buyer
from tests.settlement.test_recovery import NETWORK, _token, iso  # noqa: F401  (fixture)

GAP = 600  # blocks between the claim and an outsider's execution of the authorization


class ProviderRpc:
    """The remote provider on the wire: eth_getLogs over more than ``limit`` blocks is refused with a range
    message; the next ``failures`` eth_getLogs get ``error`` instead; every eth_getLogs takes ``delay``."""

    def __init__(self, client: EvmChain, limit: int | None = None, delay: float = 0.0) -> None:
        self.client, self.limit, self.delay = client, limit, delay
        self.failures, self.error = 0, "rate-limit"
        self.answered: list[tuple[int, int]] = []  # the windows answered, (from, to)
        self.calls = 0
        self._send = client.w3.provider._make_request  # type: ignore[attr-defined]

    def __call__(self, method: str, request_data: bytes) -> bytes:
        if method != "eth_getLogs":
            return self._send(method, request_data)
        self.calls += 1
        request = json.loads(request_data)
        query = request["params"][0]
        low, high = int(query["fromBlock"], 16), int(query["toBlock"], 16)
        if self.delay:
            time.sleep(self.delay)
        if self.failures > 0:
            self.failures -= 1
            return self._fail(request["id"])
        if self.limit is not None and high - low + 1 > self.limit:
            message = f"block range is too wide: ranges over {self.limit} blocks are not supported"
            return json.dumps(
                {"jsonrpc": "2.0", "id": request["id"], "error": {"code": -32600, "message": message}}
            ).encode()
        self.answered.append((low, high))
        return self._send(method, request_data)

    def _fail(self, request_id: int) -> bytes:
        if self.error.startswith("http-"):
            response = requests.Response()
            response.status_code = int(self.error[5:])
            response._content = b"Too Many Requests" if response.status_code == 429 else b"Service Unavailable"
            raise requests.HTTPError(f"{response.status_code} error", response=response)
        code, message = {
            "rate-limit": (-32005, "rate limit exceeded"),
            "limit-exceeded": (-32005, "limit exceeded"),
            "internal": (-32603, "internal error"),
            "beyond-head": (-32000, "block range extends beyond current head block"),
        }[self.error]
        return json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}).encode()


@pytest.fixture
def provider(iso: Any, monkeypatch: pytest.MonkeyPatch) -> Any:  # noqa: F811
    def install(limit: int | None = None, delay: float = 0.0) -> ProviderRpc:
        client = evm_chain(iso.devnet.chains.get(NETWORK))  # the client the reconciler uses
        rpc = ProviderRpc(client, limit, delay)
        monkeypatch.setattr(client.w3.provider, "_make_request", rpc)
        monkeypatch.setattr(client, "log_range_limit", None)  # nothing learned, nothing searched yet
        monkeypatch.setattr(client, "_log_answers", 0, raising=False)
        monkeypatch.setattr(client, "_log_cursors", {}, raising=False)
        return rpc

    return install


def _paid_by_outsider(iso: Any) -> str:  # noqa: F811
    """A claimed intent whose authorization an outsider executed GAP blocks after the claim (after a relayer
    outage): only the token's logs tell it is paid."""
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 1_000_000)
    intent = create_intent(iso.client, iso.shop, 1)
    payload = sign_authorization(buyer.key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504  # claimed; no relayer
    _mine(w3, GAP)
    _execute(w3, token, payload)
    w3.provider.make_request("anvil_mine", [hex(10), "0x0"])
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000  # the merchant has the money
    return str(intent["intent_id"])


def _mine(w3: Any, blocks: int) -> None:
    for _ in range(blocks // 200):  # in steps: a busy machine's Anvil takes seconds per thousand blocks
        assert "error" not in w3.provider.make_request("anvil_mine", [hex(200), "0x0"])


def _pass(iso: Any, seconds: int, chain_seconds: float = 20.0) -> dict[str, int]:  # noqa: F811
    """One reconcile pass as if ``seconds`` had passed (each pass later than the last: a touched settlement
    waits STALE_AFTER)."""
    later = datetime.now(UTC) + timedelta(seconds=seconds)
    clock_module.set_clock(lambda: later)
    try:
        return reconcile(iso.devnet.chains, Redis.from_url(iso.redis_url), iso.queue, chain_seconds=chain_seconds)
    finally:
        clock_module.set_clock(None)


@pytest.mark.parametrize("error", ["rate-limit", "limit-exceeded", "internal", "beyond-head", "http-429", "http-503"])
def test_transient_log_errors_end_the_search_without_narrowing_the_window(iso, provider, error):  # noqa: F811
    intent_id = _paid_by_outsider(iso)
    rpc = provider()
    rpc.failures, rpc.error = 3, error
    for n in range(3):
        counts = _pass(iso, 60 * (n + 1))
        assert counts["errors"] == 1 and counts["finished"] == 0, counts  # an error: never "not found"
        assert iso.intent_row(intent_id).settlement_id is not None  # still claimed: never released
    client = evm_chain(iso.devnet.chains.get(NETWORK))
    assert client.log_range_limit is None  # before the fix: halved on each, down to a few blocks, kept for good
    assert _pass(iso, 240)["finished"] == 1
    assert iso.intent_row(intent_id).status == "paid"
    assert client.log_range_limit is None
    assert rpc.calls <= 3 + 1  # the three errors, then one window of RECONCILE_LOG_BLOCK_RANGE (2,000) blocks


def test_one_search_keeps_to_the_chains_time_and_the_next_pass_goes_on_from_where_it_stopped(iso, provider):  # noqa: F811
    intent_id = _paid_by_outsider(iso)
    rpc = provider(limit=10, delay=0.05)  # a slow provider that answers 10 blocks per call: 60 calls for GAP
    passes = 0
    while iso.intent_row(intent_id).status != "paid":
        passes += 1
        assert passes <= 20, "the search does not get anywhere"
        started = time.monotonic()
        counts = _pass(iso, 60 * passes, chain_seconds=1.0)
        assert time.monotonic() - started < 2.5, counts  # before the fix: one pass walked all GAP blocks
        assert counts["errors"] == 0, counts
        if iso.intent_row(intent_id).status != "paid":
            assert counts["waiting"] == 1, counts  # unfinished: NOT_FINAL, left claimed, never released
            assert iso.intent_row(intent_id).settlement_id is not None
    assert passes >= 2  # it did take several passes
    searched = [block for low, high in rpc.answered for block in range(low, high + 1)]
    assert len(searched) == len(set(searched))  # each pass went on where the last one stopped: nothing twice
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000


def test_a_narrowed_window_grows_back_and_a_finished_search_is_not_repeated(iso, provider):  # noqa: F811
    w3, _ = _token(iso.devnet, NETWORK)
    _mine(w3, 1200)
    client = evm_chain(iso.devnet.chains.get(NETWORK))
    rpc = provider(limit=10)
    nobody, nonce = Account.create().address, bytes(32)
    head = client.block_number()
    assert client.authorization_log(nobody, nonce, head - 100, head, 200) is None
    assert client.log_range_limit is not None and client.log_range_limit <= 2 * 10  # learned from a range refusal
    rpc.limit, rpc.answered = None, []  # the provider answers any range again
    for _ in range(3):  # the searches that follow, each of another authorization
        other = Account.create().address
        assert client.authorization_log(other, nonce, head - 1100, head, 200) is None
        if client.log_range_limit is None:
            break
    widths = [high - low + 1 for low, high in rpc.answered]
    assert client.log_range_limit is None  # back to RECONCILE_LOG_BLOCK_RANGE
    assert max(widths) == 200 and len(widths) < 60, widths  # before the fix: 330 windows of 10 blocks
    rpc.answered = []
    assert client.authorization_log(other, nonce, head - 1100, head, 200) is None
    assert rpc.answered == []  # every block of it is final and was searched: not asked again


def _rpc_error(message: str, code: int = -32000) -> Web3RPCError:
    return Web3RPCError(json.dumps({"code": code, "message": message}), rpc_response={"error": {"message": message}})


def _http(status: int, body: str = "") -> requests.HTTPError:
    response = requests.Response()
    response.status_code, response._content = status, body.encode()
    return requests.HTTPError(f"{status}", response=response)


def test_only_answers_that_name_a_range_or_result_limit_narrow_the_window():
    from backend.chains.evm import is_range_limit

    ranges = [
        _rpc_error("query returned more than 10000 results. Try with this block range [0x1, 0x2].", -32005),
        _rpc_error("Log response size exceeded. You can make eth_getLogs requests with up to a 2K block range"),
        _rpc_error("eth_getLogs is limited to a 10,000 range", -32602),
        _rpc_error("block range is too wide", -32600),
        _rpc_error("Block range limit exceeded."),
        _rpc_error("exceed maximum block range: 5000"),
        _rpc_error("Exceeded max range limit for eth_getLogs: 800", -32047),
        _http(413),
        _http(400, '{"error":{"message":"block range too large"}}'),
    ]
    transient = [
        _rpc_error("rate limit exceeded", -32005),
        _rpc_error("limit exceeded", -32005),
        _rpc_error("project ID request rate exceeded", -32005),
        _rpc_error("internal error", -32603),
        _rpc_error("block range extends beyond current head block"),
        _rpc_error("header not found"),
        _http(429, "Too Many Requests"),
        _http(400, "bad request"),
        _http(403),
        _http(503),
    ]
    assert [is_range_limit(exc) for exc in ranges] == [True] * len(ranges)
    assert [is_range_limit(exc) for exc in transient] == [False] * len(transient)
