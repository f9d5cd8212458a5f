"""How a Solana settlement is decided from the chain, on states the local RPC cannot produce
(RPC lag, a transaction landing between two reads, a failure seen only at `processed`).

The chain is a stand-in (those states cannot be made on one in-process SVM); the decisions are real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from solders.hash import Hash
from solders.keypair import Keypair

from backend.rails.base import COMMON_COLUMNS, Claim
from backend.rails.solana import rail as solana_rail
from backend.settlement import reconcile, services
from backend.settlement import solana as settlement_solana
from payintent import solana_tx as stx


@dataclass
class FakeChain:
    heights: list[int]
    statuses: list[dict[str, Any] | None]
    blockhash_valid: bool = False
    calls: list[str] = field(default_factory=list)

    def block_height(self, commitment: str = "confirmed") -> int:
        self.calls.append(f"height:{commitment}")
        return self.heights.pop(0) if len(self.heights) > 1 else self.heights[0]

    def signature_status(self, signature: str) -> dict[str, Any] | None:
        self.calls.append("status")
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def is_blockhash_valid(self, blockhash: str) -> bool:
        self.calls.append("blockhash")
        return self.blockhash_valid

    def genesis_hash(self) -> str:
        self.calls.append("genesis")
        return "G1"


@dataclass
class Row:
    id: str = "stl_1"
    merchant_id: str = "mer_1"
    network: str = "solana:test"
    tx_hash: str | None = "5sig"
    intent_id: str = "int_1"
    asset: str = "mint"
    payer: str = "payer"
    pay_to: str = "owner"
    amount_atomic: int = 1
    nonce: str = "0x" + "ab" * 32
    relay_address: str | None = "relay"
    start_block: int | None = None
    last_valid_block_height: int = 1000
    signed_transaction: str = field(
        default_factory=lambda: stx.encode(
            stx.build_payment(
                fee_payer=str(Keypair().pubkey()),
                payer=str(Keypair().pubkey()),
                mint=str(Keypair().pubkey()),
                pay_to=str(Keypair().pubkey()),
                amount_atomic=1,
                intent_id="i",
                recent_blockhash=str(Hash.new_unique()),
            )
        )
    )


@pytest.fixture
def decided(monkeypatch) -> list[tuple[str, ...]]:
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(services, "complete_settlement", lambda sid, tx: calls.append(("paid", sid, tx)) or True)
    monkeypatch.setattr(
        services, "fail_settlement", lambda sid, code, reason: calls.append(("failed", sid, code)) or True
    )
    return calls


@pytest.fixture
def charged(monkeypatch) -> list[tuple[Any, ...]]:
    """The fees recorded on merchants' relay budgets (the ledger itself is tested on a database elsewhere)."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(settlement_solana.relaybudget, "charge", lambda *args: calls.append(args) or True)
    # The payee account a landed payment is recorded in (the table is tested on a database elsewhere).
    monkeypatch.setattr(
        settlement_solana, "record_payee_account",
        lambda network_id, owner, mint, genesis: calls.append(("payee", owner, genesis)),
    )  # fmt: skip
    return calls


@pytest.fixture(autouse=True)
def settlement_solana_finish(monkeypatch) -> None:
    """``settlement_solana.finish_from_chain(chain, row)``: the generic finish (``reconcile.finish_from_chain``) of
    a Solana settlement on the stand-in chain (the rail's client), its claim read from the row's columns."""

    def claim_of(row: Row) -> Claim:
        columns = {name: getattr(row, name) for name in (*COMMON_COLUMNS, *solana_rail.SOLANA_RAIL.columns)}
        terms = solana_rail.SOLANA_RAIL.terms_from_columns(columns)
        return Claim(row.id, row.intent_id, row.asset, terms, row.tx_hash, row.relay_address, row.start_block)

    def finish_from_chain(chain: FakeChain, row: Row) -> bool:
        monkeypatch.setattr(solana_rail, "solana_chain", lambda network: chain)
        return reconcile.finish_from_chain(SimpleNamespace(network=row.network, kind="solana"), row)

    monkeypatch.setattr(reconcile, "settlement_claim", claim_of)
    monkeypatch.setattr(settlement_solana, "finish_from_chain", finish_from_chain, raising=False)


def test_height_is_read_before_status_so_a_late_landing_is_seen(decided, charged):
    chain = FakeChain(heights=[1001], statuses=[{"confirmationStatus": "confirmed", "err": None}])
    assert settlement_solana.finish_from_chain(chain, Row()) is True
    assert chain.calls == ["height:finalized", "status", "genesis"]
    assert decided == [("paid", "stl_1", "5sig")]
    assert charged == [("mer_1", "solana:test", "fee", 10_040, "5sig", "stl_1"),  # two signatures + 40 priority
                       ("payee", "owner", "G1")]  # fmt: skip


def test_not_released_while_the_node_still_accepts_the_blockhash(decided, charged):
    chain = FakeChain(heights=[5000], statuses=[None], blockhash_valid=True)
    assert settlement_solana.finish_from_chain(chain, Row()) is False
    assert decided == [] and charged == []


def test_not_released_before_the_margin_even_if_unknown(decided, charged):
    chain = FakeChain(heights=[1000], statuses=[None])
    assert settlement_solana.finish_from_chain(chain, Row()) is False
    assert decided == [] and charged == []


def test_released_only_when_past_the_margin_and_the_blockhash_is_dead(decided, charged):
    chain = FakeChain(heights=[1001], statuses=[None], blockhash_valid=False)
    assert settlement_solana.finish_from_chain(chain, Row()) is True
    assert decided == [("failed", "stl_1", "AUTHORIZATION_EXPIRED")]
    assert charged == []  # it never landed: no fee was paid


def test_a_failure_seen_only_at_processed_decides_nothing(decided, charged):
    chain = FakeChain(heights=[5000], statuses=[{"confirmationStatus": "processed", "err": {"InstructionError": []}}])
    assert settlement_solana.finish_from_chain(chain, Row()) is False
    assert decided == [] and charged == []


def test_a_confirmed_failure_fails_the_settlement(decided, charged):
    chain = FakeChain(heights=[10], statuses=[{"confirmationStatus": "confirmed", "err": {"InstructionError": []}}])
    assert settlement_solana.finish_from_chain(chain, Row()) is True
    assert decided == [("failed", "stl_1", "SETTLEMENT_FAILED")]
    assert [c[2:4] for c in charged] == [("fee", 10_040)]  # a failed transaction that landed still cost its fee
