"""The timing seam (backend.timing) sees POST /x402/pay's real steps in order: the seam bench/pay's
in-process breakdown times submit_payment through, instead of a copy of its steps."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm.attributes import flag_modified

from backend import timing
from backend.chains.evm import evm_chain
from backend.errors import DomainError
from backend.extensions import db
from backend.intents.models import Intent
from payintent.eip3009 import sign_authorization
from tests.settlement.test_pay import create_intent, pay, requirement

NETWORK = "eip155:84532"
BEFORE_THE_RAIL = [
    "load_payable_intent",
    "check_payable",
    "normalize_payment_signature",
    "requirement_for",
    "check_pay_to_current",
    "check_asset_current",  # REQUIREMENT_OUTDATED when the USDC contract changed since the intent was made
]


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []  # (enter | exit, step, the DomainError's code)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.seen.append(("enter", name, None))
        try:
            yield
        except DomainError as err:
            self.seen.append(("exit", name, err.code))
            raise
        self.seen.append(("exit", name, None))

    def entered(self) -> list[str]:
        return [name for what, name, _ in self.seen if what == "enter"]


def test_no_recorder_is_one_shared_context_that_does_nothing():
    assert timing.step("a") is timing.step("b")
    with timing.step("a") as value:
        assert value is None


def test_one_recorder_at_a_time_and_none_after():
    with timing.recording(Recorder()), pytest.raises(RuntimeError), timing.recording(Recorder()):
        pass
    assert timing._recorder is None


def test_a_payment_passes_every_step_in_order(pay_client, shop, devnet):
    intent = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, NETWORK))
    recorder = Recorder()
    with timing.recording(recorder):
        response = pay(pay_client, shop, intent, NETWORK, payload)
    assert response.status_code == 200, response.get_json()
    assert recorder.entered() == [
        *BEFORE_THE_RAIL,
        "parse_payment",
        "check_on_chain",
        "chain_reads",
        "budget",
        "claim",
        "enqueue_settlement",
        "wait_settled",
        "settlement_result",
    ]
    assert [code for what, _, code in recorder.seen if what == "exit"] == [None] * len(recorder.entered())
    # Nested: the rail's reads are inside check_on_chain.
    names = [(what, name) for what, name, _ in recorder.seen]
    assert names.index(("exit", "chain_reads")) < names.index(("exit", "check_on_chain"))


def test_the_outdated_asset_check_is_a_step_and_stops_the_payment(pay_app, pay_client, shop, devnet):
    intent = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(1).key, requirement(intent, NETWORK))
    with pay_app.app_context():  # as if the intent was made when the network's USDC was another contract
        row = db.session.get(Intent, intent["intent_id"])
        assert row is not None
        requirements: list[dict[str, Any]] = [dict(r) for r in row.payment_requirements]
        for r in requirements:
            if r["network"] == NETWORK:
                r["asset"] = "0x" + "11" * 20
        row.payment_requirements = requirements
        flag_modified(row, "payment_requirements")
        db.session.commit()
    recorder = Recorder()
    with timing.recording(recorder):
        response = pay(pay_client, shop, intent, NETWORK, payload)
    assert response.status_code == 409 and response.get_json()["error"]["code"] == "REQUIREMENT_OUTDATED"
    assert recorder.entered() == BEFORE_THE_RAIL
    assert recorder.seen[-1] == ("exit", "check_asset_current", "REQUIREMENT_OUTDATED")


def test_the_chain_reads_before_the_claim_are_one_round_trip(pay_app, pay_client, shop, devnet):
    """The nonce, code, balance and latest-block reads go to the chain as one JSON-RPC batch: one HTTP POST."""
    with pay_app.app_context():
        network = next(n for n in pay_app.extensions["payintent.chains"] if n.network == NETWORK)
        manager = evm_chain(network).w3.provider._request_session_manager
    posts: list[Any] = []
    post = manager.make_post_request

    def counting_post(uri: str, data: Any, *args: Any, **kwargs: Any) -> Any:
        posts.append(json.loads(data))
        return post(uri, data, *args, **kwargs)

    class Counting(Recorder):
        @contextlib.contextmanager
        def __call__(self, name: str) -> Iterator[None]:
            before = len(posts)
            with super().__call__(name):
                yield
            if name == "chain_reads":
                self.reads = posts[before:]

    intent = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(2).key, requirement(intent, NETWORK))
    recorder = Counting()
    manager.make_post_request = counting_post
    try:
        with timing.recording(recorder):
            response = pay(pay_client, shop, intent, NETWORK, payload)
    finally:
        del manager.make_post_request  # the class's method again
    assert response.status_code == 200, response.get_json()
    (batch,) = recorder.reads
    assert [call["method"] for call in batch] == ["eth_call", "eth_getCode", "eth_call", "eth_getBlockByNumber"]


def test_the_claim_and_the_answer_make_few_statements(pay_app, pay_client, shop, devnet):
    """The claim reads no intent (the pre-claim rollback's expired one is not reloaded), counts both open caps in one
    statement under both locks, inserts and makes its conditional update as plain statements and commits once; the
    answer is one statement (the settlement with its intent's paid_at)."""
    with pay_app.app_context():
        engine = db.engine
    statements: dict[str, list[str]] = {}
    commits: dict[str, int] = {}

    class Counting(Recorder):
        current: list[str] = []

        @contextlib.contextmanager
        def __call__(self, name: str) -> Iterator[None]:
            self.current.append(name)
            try:
                with super().__call__(name):
                    yield
            finally:
                self.current.pop()

    recorder = Counting()

    def capture(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if recorder.current:
            statements.setdefault(recorder.current[-1], []).append(" ".join(statement.split()))

    def commit(conn: Any) -> None:
        if recorder.current:
            commits[recorder.current[-1]] = commits.get(recorder.current[-1], 0) + 1

    intent = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, NETWORK))
    event.listen(engine, "before_cursor_execute", capture)
    event.listen(engine, "commit", commit)
    try:
        with timing.recording(recorder):
            response = pay(pay_client, shop, intent, NETWORK, payload)
    finally:
        event.remove(engine, "before_cursor_execute", capture)
        event.remove(engine, "commit", commit)
    assert response.status_code == 200, response.get_json()
    claim = statements["claim"]
    postgresql = engine.dialect.name == "postgresql"
    expected = [
        "SELECT wallets.address FROM wallets",  # locked (PostgreSQL: FOR UPDATE)
        *(["SELECT pg_advisory_xact_lock"] * 2 if postgresql else ["UPDATE intents SET updated_at=intents.updated_at"]),
        "SELECT (SELECT count(*)",  # the merchant's and the payer's open settlements
        "INSERT INTO settlements",
        "UPDATE intents SET updated_at=",  # the conditional update
        "SELECT coalesce(sum(relay_spending.amount_atomic)",  # the relay budget's admit
    ]
    assert len(claim) == len(expected) and all(s.startswith(e) for s, e in zip(claim, expected, strict=True)), claim
    assert commits == {"claim": 1}
    (answer,) = statements["settlement_result"]
    assert "JOIN intents" in answer
