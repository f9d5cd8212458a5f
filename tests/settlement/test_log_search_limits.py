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
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from eth_account import Account
from redis import Redis
from web3.exceptions import Web3RPCError

from backend import clock as clock_module
from backend.chains import evm as evm_module
from backend.chains.evm import LOG_CURSOR_MARGIN, EvmChain, LogSearchIncomplete, evm_chain
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
    client = evm_chain(iso.devnet.chains.get(NETWORK))
    kept_to = client.final_block(client.block_number()) - max(LOG_CURSOR_MARGIN, client.network.confirmations)
    twice = {block for block in searched if searched.count(block) > 1}
    assert all(block > kept_to for block in twice), twice  # each pass went on where the last one stopped,
    # searching nothing twice but the newest LOG_CURSOR_MARGIN blocks (never trusted to a cursor)
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000


def test_a_narrowed_window_grows_back_and_a_finished_search_with_no_match_is_asked_again(iso, provider):  # noqa: F811
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
    # Review 4, F1: no match up to the end while the authorization is used means an answer was incomplete (a
    # lagging node): the search keeps no cursor and starts again at the claim's block, at the full width.
    assert rpc.answered[0] == (head - 1100, head - 901) and rpc.answered[-1][1] == head


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


@pytest.mark.parametrize(
    "message",
    [
        # Alchemy's refusal today (BobTheBuidler/dank_mids#772): no limit word at all
        "You can make eth_getLogs requests with up to a 500 block range. Based on your parameters, this block "
        "range should work: [0x123c9b2, 0x123cba5]",
        # Alchemy's free tier
        "Under the Free tier plan, you can make eth_getLogs requests with up to a 10 block range. Based on your "
        "parameters, this block range should work: [0x1, 0xa]. Upgrade to PAYG for expanded block range.",
        # "rate" inside an ordinary word is not a rate limit
        "block range too large, please separate your query into smaller ranges",
    ],
)
def test_alchemys_range_refusals_narrow_the_window(message):
    """Review 4, F3: these were taken for other errors (no limit word; "sepa-rate"), so the window was never
    halved and every search raised on every pass above the provider's cap."""
    from backend.chains.evm import is_range_limit

    assert is_range_limit(_rpc_error(message, -32600))


def test_rate_limits_that_mention_a_block_range_do_not_narrow_the_window():
    from backend.chains.evm import is_range_limit

    for exc in (
        _rpc_error("rate limit exceeded for eth_getLogs with a 500 block range", -32005),
        _rpc_error("Too many requests: up to a 500 block range per second", -32005),
        _rpc_error("You have exceeded your daily request quota; block range 10", -32005),
        _rpc_error("ratelimited: block range requests throttled", -32005),
        _http(429, "You can make eth_getLogs requests with up to a 500 block range"),
    ):
        assert not is_range_limit(exc), exc


class LaggingIndex:
    """A provider whose log index (or the load-balanced node that serves eth_getLogs) is behind the node that
    answered eth_blockNumber, for ``lagging_calls`` eth_getLogs: it answers the blocks up to ``indexed_to``
    and nothing for the newer ones, with no error (ethereum/go-ethereum#24078, #26098)."""

    def __init__(self, client: EvmChain) -> None:
        self.indexed_to: int | None = None
        self.lagging_calls = 0
        self.calls: list[tuple[int, int]] = []
        self._send = client.w3.provider._make_request  # type: ignore[attr-defined]

    def __call__(self, method: str, data: bytes) -> bytes:
        if method == "eth_getLogs":
            request = json.loads(data)
            query = request["params"][0]
            low, high = int(query["fromBlock"], 16), int(query["toBlock"], 16)
            self.calls.append((low, high))
            if self.indexed_to is not None and self.lagging_calls > 0 and high > self.indexed_to:
                self.lagging_calls -= 1
                if low > self.indexed_to:  # nothing of this window indexed yet
                    return json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": []}).encode()
                query["toBlock"] = hex(self.indexed_to)
                data = json.dumps(request).encode()
        return self._send(method, data)


def test_an_empty_answer_from_a_lagging_node_is_searched_again_next_pass(iso, monkeypatch):  # noqa: F811
    """Review 4, F1: a search that reached its end with no match was remembered up to the newest final block
    (the head itself with confirmations 1), so a block a lagging node answered empty for was never searched
    again: the intent, paid by an outsider, stayed claimed for the life of the worker."""
    w3, token = _token(iso.devnet, NETWORK)
    buyer = funded_buyer(w3, token, iso.devnet, 1_000_000)
    intent = create_intent(iso.client, iso.shop, 1)
    intent_id = str(intent["intent_id"])
    payload = sign_authorization(buyer.key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504  # claimed; no relayer
    before = w3.eth.block_number
    _execute(w3, token, payload)  # an outsider executes the public signature: the merchant is paid
    executed_in = w3.eth.block_number
    assert executed_in == before + 1
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000

    client = evm_chain(iso.devnet.chains.get(NETWORK))  # the reconciler's client (one per worker process)
    monkeypatch.setattr(client, "_log_cursors", {})
    rpc = LaggingIndex(client)
    monkeypatch.setattr(client.w3.provider, "_make_request", rpc)
    rpc.indexed_to, rpc.lagging_calls = executed_in - 1, 1  # one answer misses the newest block
    counts = _pass(iso, 60)
    assert counts["waiting"] == 1 and counts["finished"] == 0, counts  # used, log not found: NOT_FINAL

    w3.provider.make_request("anvil_mine", [hex(5), "0x0"])
    counts = _pass(iso, 120)  # every answer is exact again
    assert counts["finished"] == 1, counts  # before the fix: `waiting` on every pass, only blocks 7+ asked
    assert iso.intent_row(intent_id).status == "paid"
    assert rpc.calls[-1][0] <= executed_in  # searched again from the claim's block
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000


def test_an_unfinished_search_remembers_only_blocks_well_behind_the_head(iso, provider, monkeypatch):  # noqa: F811
    """The cursor kept across a search that ran out of time never reaches the last LOG_CURSOR_MARGIN blocks
    (nor the network's confirmations, if more): a lagging node's empty answer there is asked again."""
    w3, _ = _token(iso.devnet, NETWORK)
    _mine(w3, 400)
    client = evm_chain(iso.devnet.chains.get(NETWORK))
    rpc = provider()
    ticks = iter(range(1_000_000))  # the clock: one tick per look (the deadline is checked before each window)
    monkeypatch.setattr(evm_module, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    nobody, nonce = Account.create().address, bytes(32)
    head = client.block_number()
    with pytest.raises(LogSearchIncomplete):  # out of time after the first window
        client.authorization_log(nobody, nonce, head - 100, head, 10, -1)
    ((first, last),) = client._log_cursors.values()
    assert (first, last) == (head - 100, head - 91)  # one window of 10, well behind the head: kept
    deadline = next(ticks) + 7  # 8 more windows (the first is not checked): blocks head-90 .. head-11
    with pytest.raises(LogSearchIncomplete):
        client.authorization_log(nobody, nonce, head - 100, head, 10, deadline)
    assert rpc.answered[-1] == (head - 20, head - 11)
    ((first, last),) = client._log_cursors.values()
    margin = max(LOG_CURSOR_MARGIN, client.network.confirmations)
    assert (first, last) == (head - 100, client.final_block(head) - margin)  # never the newest blocks
    rpc.answered = []
    assert client.authorization_log(nobody, nonce, head - 100, head, 10) is None  # goes on and reaches the end
    assert rpc.answered[0][0] == last + 1  # resumed where the kept part ended
    assert client._log_cursors == {}  # finished with no match: forgotten, the next search starts again
