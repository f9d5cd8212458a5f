"""Many JSON-RPC reads in one HTTP round trip (a JSON-RPC batch), for the EVM rail's watch and block watcher.

Raw answers (hex quantities, ``None`` for "not found"), one per call, in the order asked. web3's own
``w3.batch_requests()`` is not used: it raises for the whole batch when one element errors, and turns a ``null``
receipt (not mined yet, the usual answer) into ``TransactionNotFound`` for the whole batch too. Nor is the
provider's ``make_batch_request``: it numbers the calls itself and sorts the answers by id, so which answer is
which call's is never checked. The batch is posted here, through the provider's own HTTP session, with ids of
this module's own, and each answer is matched to its call by id: the ids must be exactly the ones sent (ints,
each once), and a receipt, a transaction or a block must be the one asked (its hash or its number). An answer
that is someone else's is asked again alone.

A node that says it does not take batches (a JSON-RPC error for the whole batch with code -32600 or -32601, or an
HTTP 400, 405, 413 or 415 to a batch) is asked one call each instead, for ``BATCH_RETRY_SECONDS``
(``RpcCounter.batches_refused``), then a batch again. Any other answer that is not one answer per call (a single
error object, ids missing, repeated, renumbered or of another type) makes that batch unusable: its calls are asked
one each, this time only. One element's error is that element's ``Answer.error``, never the batch's. A timeout,
a refused connection, a 5xx or a rate limit (HTTP 429, or an error whose code or message says so, for the batch
or an element) raises (``requests``' exceptions, ``Web3RPCError``): the RPC, not one call, is in trouble, and
asking each call alone would only add to its load.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests
from web3 import Web3
from web3.exceptions import Web3RPCError
from web3.types import RPCEndpoint

from backend.chains.evm import RPC_CONNECT_ATTEMPTS

# The most calls sent in one batch: providers cap a batch's size (often 100 to 1,000 calls); more calls are sent
# as several batches of at most this many.
MAX_BATCH = 100
# After a node said it does not take batches, one call each for this long, then a batch again (a deploy, a
# proxy's setting changed back).
BATCH_RETRY_SECONDS = 600.0
# Reads: a batch of them only is sent again after a reset connection (it may have been processed already).
READ_METHODS = frozenset(
    {
        "eth_getTransactionReceipt",
        "eth_getTransactionByHash",
        "eth_getBlockByNumber",
        "eth_blockNumber",
        "eth_getCode",
        "eth_getBalance",
        "eth_call",
        "eth_chainId",
        "eth_getTransactionCount",
    }
)
# "This is not a batch I take": invalid request, method not found (the batch, a list, is no method).
REFUSAL_CODES = frozenset({-32600, -32601})
REFUSAL_STATUSES = frozenset({400, 405, 413, 415})
# Rate limits sent in a JSON-RPC error: EIP-1474's "limit exceeded" (-32005), -32007 and 429 some providers use.
RATE_LIMIT_CODES = frozenset({-32005, -32007, 429})
RATE_LIMIT_MESSAGE = re.compile(r"rate[\s_-]*limit|too many requests", re.IGNORECASE)

_HEX_QUANTITY = re.compile(r"0x[0-9a-fA-F]+")
_ids = itertools.count(1)  # this module's JSON-RPC ids (next() on a count is atomic in CPython)


@dataclass(frozen=True)
class Answer:
    """One call's answer: its ``result`` (``None``: the node has nothing, such as no receipt yet), or ``error`` (the
    node's error message; then ``result`` means nothing)."""

    result: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class RpcCounter:
    """What a reader asked of its RPC: JSON-RPC calls, HTTP round trips (a batch is one), and the batches among
    them. ``refused_at``: when the node last said it takes no batches (``time.monotonic()``)."""

    calls: int = 0
    round_trips: int = 0
    batches: int = 0
    refused_at: float | None = None

    @property
    def batches_refused(self) -> bool:
        """Whether the node refused a batch less than BATCH_RETRY_SECONDS ago (reads ask one call each)."""
        return self.refused_at is not None and time.monotonic() - self.refused_at < BATCH_RETRY_SECONDS

    def refuse(self) -> None:
        self.refused_at = time.monotonic()

    def snapshot(self) -> tuple[int, int, int]:
        return self.calls, self.round_trips, self.batches


def quantity(value: Any) -> int:
    """A JSON-RPC quantity (``"0x1a"``, a decimal text or an int) as an int; ``None`` is 0."""
    if isinstance(value, str):
        return int(value, 16) if value.startswith("0x") else int(value)
    return int(value or 0)


def strict_quantity(value: Any) -> int:
    """A JSON-RPC quantity, strictly: ``0x`` and hex digits; anything else (None, a decimal text, an int, a sign,
    spaces) raises ``ValueError``: where a malformed answer is the node's trouble, never a number (``quantity`` is
    lenient)."""
    if not isinstance(value, str) or _HEX_QUANTITY.fullmatch(value) is None:
        raise ValueError("not a hex quantity")
    return int(value[2:], 16)


def call_one(w3: Web3, method: str, params: Sequence[Any], counter: RpcCounter) -> Answer:
    """One call (through the provider, with its retry of a refused connection), its error as an ``Answer`` (an
    answer that is not the receipt, transaction or block asked is an error too)."""
    counter.calls += 1
    counter.round_trips += 1
    answer = _answer(w3.provider.make_request(RPCEndpoint(method), list(params)))
    if answer.ok and not _matches(method, params, answer.result):
        return Answer(error=f"{method}: the answer is not the one asked")
    return answer


def call_many(w3: Web3, calls: Sequence[tuple[str, Sequence[Any]]], counter: RpcCounter) -> list[Answer]:
    """Each ``(method, params)``'s answer, in order: in batches of at most MAX_BATCH calls (one batch for up to
    MAX_BATCH calls), or one call each where the node refuses batches or a batch's answer is unusable."""
    answers: list[Answer] = []
    for start in range(0, len(calls), MAX_BATCH):
        chunk = calls[start : start + MAX_BATCH]
        batch = None if counter.batches_refused or len(chunk) == 1 else _batch(w3, chunk, counter)
        if batch is None:
            batch = [call_one(w3, method, params, counter) for method, params in chunk]
        answers.extend(batch)
    return answers


def _batch(w3: Web3, calls: Sequence[tuple[str, Sequence[Any]]], counter: RpcCounter) -> list[Answer] | None:
    """The answers of one batch, or None: the node refused it (then ``counter.refuse()``) or its answer is unusable."""
    provider: Any = w3.provider
    if getattr(provider, "_request_session_manager", None) is None:  # not an HTTP provider: no batches
        counter.refuse()
        return None
    ids = [next(_ids) for _ in calls]
    counter.calls += len(calls)
    counter.round_trips += 1
    counter.batches += 1
    try:
        response = _post_batch(provider, calls, ids)
    except requests.HTTPError as exc:
        # 429 and 5xx are the RPC's trouble and raise, as one call's would; so does a 401/403/404 (the URL, the key).
        status = exc.response.status_code if exc.response is not None else 0
        if status not in REFUSAL_STATUSES:
            raise
        counter.refuse()
        return None
    except ValueError:  # not JSON (a proxy's error page)
        return None
    if isinstance(response, Mapping):  # one answer for the whole batch: an error
        error = response.get("error")
        _raise_if_rate_limited(error)
        if isinstance(error, Mapping) and error.get("code") in REFUSAL_CODES:
            counter.refuse()
        return None
    by_id = _by_id(response, ids)
    if by_id is None:
        return None
    answers: list[Answer] = []
    for call_id, (method, params) in zip(ids, calls, strict=True):
        _raise_if_rate_limited(by_id[call_id].get("error"))
        answer = _answer(by_id[call_id])
        if answer.ok and not _matches(method, params, answer.result):
            answer = call_one(w3, method, params, counter)  # another call's answer: asked again alone
        answers.append(answer)
    return answers


def _by_id(response: Any, ids: list[int]) -> dict[int, Mapping[str, Any]] | None:
    """The answers by id, if they are one per call with exactly the ids sent (ints, each once); else None."""
    if not isinstance(response, list) or len(response) != len(ids):
        return None
    by_id: dict[int, Mapping[str, Any]] = {}
    for item in response:
        call_id = item.get("id") if isinstance(item, Mapping) else None
        if type(call_id) is not int or call_id in by_id:  # True is an int, "7" is not 7
            return None
        by_id[call_id] = item
    return by_id if by_id.keys() == set(ids) else None


def _matches(method: str, params: Sequence[Any], result: Any) -> bool:
    """Whether a receipt, a transaction or a block (not ``None``) is the one asked: its hash, its number."""
    if result is None or not params:
        return True
    field = {"eth_getTransactionReceipt": "transactionHash", "eth_getTransactionByHash": "hash"}.get(method)
    if field is not None:
        return isinstance(result, Mapping) and str(result.get(field) or "").lower() == str(params[0]).lower()
    if method == "eth_getBlockByNumber" and isinstance(params[0], str) and params[0].startswith("0x"):
        return (
            isinstance(result, Mapping)
            and result.get("number") is not None
            and (quantity(result["number"]) == quantity(params[0]))
        )
    return True


def _raise_if_rate_limited(error: Any) -> None:
    if error is None:
        return
    code = error.get("code") if isinstance(error, Mapping) else None
    message = str(error.get("message") if isinstance(error, Mapping) else error)
    if code in RATE_LIMIT_CODES or RATE_LIMIT_MESSAGE.search(message):
        raise Web3RPCError(f"rate limited: {message}")


def _post_batch(provider: Any, calls: Sequence[tuple[str, Sequence[Any]]], ids: list[int]) -> Any:
    """The node's answer to the batch (decoded JSON), posted through the provider's HTTP session (its pooled
    connections, its headers and timeouts). A batch of reads only (READ_METHODS) is sent again once if the
    connection was refused or reset (a stale pooled connection), as web3 does for one call but not a batch."""
    body = [{"jsonrpc": "2.0", "id": i, "method": m, "params": list(p)} for i, (m, p) in zip(ids, calls, strict=True)]
    data = json.dumps(body).encode()
    attempts = RPC_CONNECT_ATTEMPTS if all(method in READ_METHODS for method, _ in calls) else 1
    for attempt in range(1, attempts + 1):
        try:
            raw = provider._request_session_manager.make_post_request(
                provider.endpoint_uri, data, **provider.get_request_kwargs()
            )
            return json.loads(raw)
        except requests.ConnectionError:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def _answer(response: Any) -> Answer:
    if not isinstance(response, dict):
        return Answer(error=f"unexpected answer {type(response).__name__}")
    error = response.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else None
        return Answer(error=str(message or error))
    if "result" not in response:
        return Answer(error="answer without a result")
    return Answer(result=response["result"])
