"""Many JSON-RPC reads in one HTTP round trip (a JSON-RPC batch), for the EVM rail's watch and block watcher.

Raw answers (hex quantities, ``None`` for "not found"), one per call, in the order asked. web3's own
``w3.batch_requests()`` is not used: it raises for the whole batch when one element errors, and turns a ``null``
receipt (not mined yet, the usual answer) into ``TransactionNotFound`` for the whole batch too.

A node that refuses batches (a single error object instead of a list, an HTTP 4xx other than 429, a list that
does not answer each call once) is asked one call each instead, and not asked for a batch again by this process
(``RpcCounter.batches_refused``). One element's error is that element's ``Answer.error``, never the batch's. A
timeout, a refused connection, a 429 or a 5xx raises (``requests``' exceptions): the RPC, not one call, is in
trouble.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests
from web3 import Web3
from web3.types import RPCEndpoint

from backend.chains.evm import RPC_CONNECT_ATTEMPTS

# The most calls sent in one batch: providers cap a batch's size (often 100 to 1,000 calls); more calls are sent
# as several batches of at most this many.
MAX_BATCH = 100


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
    them. ``batches_refused``: the node refused a batch once; later reads ask one call each."""

    calls: int = 0
    round_trips: int = 0
    batches: int = 0
    batches_refused: bool = False

    def snapshot(self) -> tuple[int, int, int]:
        return self.calls, self.round_trips, self.batches


def quantity(value: Any) -> int:
    """A JSON-RPC quantity (``"0x1a"``, a decimal text or an int) as an int; ``None`` is 0."""
    if isinstance(value, str):
        return int(value, 16) if value.startswith("0x") else int(value)
    return int(value or 0)


def call_one(w3: Web3, method: str, params: Sequence[Any], counter: RpcCounter) -> Answer:
    """One call (through the provider, with its retry of a refused connection), its error as an ``Answer``."""
    counter.calls += 1
    counter.round_trips += 1
    response = w3.provider.make_request(RPCEndpoint(method), list(params))
    return _answer(response)


def call_many(w3: Web3, calls: Sequence[tuple[str, Sequence[Any]]], counter: RpcCounter) -> list[Answer]:
    """Each ``(method, params)``'s answer, in order: in batches of at most MAX_BATCH calls (one batch for up to
    MAX_BATCH calls), or one call each where the node refuses batches (then for good, ``counter``)."""
    answers: list[Answer] = []
    for start in range(0, len(calls), MAX_BATCH):
        chunk = calls[start : start + MAX_BATCH]
        batch = None if counter.batches_refused or len(chunk) == 1 else _batch(w3, chunk, counter)
        if batch is None:
            batch = [call_one(w3, method, params, counter) for method, params in chunk]
        answers.extend(batch)
    return answers


def _batch(w3: Web3, calls: Sequence[tuple[str, Sequence[Any]]], counter: RpcCounter) -> list[Answer] | None:
    """The answers of one batch, or None (and ``counter.batches_refused``) if the node refused it."""
    provider: Any = w3.provider
    counter.calls += len(calls)
    counter.round_trips += 1
    counter.batches += 1
    try:
        response = _post_batch(provider, [(RPCEndpoint(method), list(params)) for method, params in calls])
    except requests.HTTPError as exc:
        # A 4xx for the batch as a whole (400, 405, 413, "batch not supported") is a refusal; a rate limit (429) or
        # a 5xx is the RPC's trouble and raises, as one call's would.
        status = exc.response.status_code if exc.response is not None else 0
        if status == 429 or not 400 <= status < 500:
            raise
        counter.batches_refused = True
        return None
    except NotImplementedError:  # a provider without batches
        counter.batches_refused = True
        return None
    # A list answering each call once, each with its id (sorted by id by web3: the order asked). Anything else (a
    # single error object, a shorter list, answers without ids whose order nothing proves) is a refusal.
    if (
        not isinstance(response, list)
        or len(response) != len(calls)
        or any(not isinstance(item, dict) or item.get("id") is None for item in response)
    ):
        counter.batches_refused = True
        return None
    return [_answer(item) for item in response]


def _post_batch(provider: Any, calls: list[tuple[RPCEndpoint, list[Any]]]) -> Any:
    """The provider's batch, tried again once if the connection was refused or reset (a stale pooled connection):
    what web3's retry (``EvmChain``: RPC_CONNECT_ATTEMPTS) does for one call but not for a batch."""
    for attempt in range(1, RPC_CONNECT_ATTEMPTS + 1):
        try:
            return provider.make_batch_request(calls)
        except requests.ConnectionError:
            if attempt == RPC_CONNECT_ATTEMPTS:
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
