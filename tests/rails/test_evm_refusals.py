"""The pipelined EVM relay when the node answers a broadcast with a refusal after the settlement recorded its
(tx hash, relay nonce), on a real Anvil with our TestUSDC: the nonce is never handed out again (two rows would
share it) nor taken as in flight; it is filled at once (a cancel, or the same transfer re-signed there after
"underpriced"), else by the pool's repair step, so the account's later settlements are mined without a restart.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from eth_account import Account
from web3.exceptions import Web3RPCError

from backend.chains.evm import evm_chain
from backend.rails.base import LeftOpen, TxState
from backend.rails.evm import accounts as accounts_module
from backend.rails.evm import pipeline, relay
from backend.rails.evm.rail import EVM_RAIL
from backend.rails.evm.relay import RelayUnavailable
from tests.rails.test_evm_pipeline import NETWORK, Chain, _claim_of, _reset, _submit, _until, node  # noqa: F401
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)


def _refuse(node: Chain, monkeypatch: pytest.MonkeyPatch, *messages: str) -> list[bytes]:  # noqa: F811
    """The node answers the next broadcasts with ``messages`` (a JSON-RPC error each), then takes them."""
    assert evm_chain(node.network) is node.chain
    real = node.w3.eth.send_raw_transaction
    left = list(messages)
    refused: list[bytes] = []

    def send(raw: Any) -> Any:
        if left:
            refused.append(bytes(raw))
            raise Web3RPCError(left.pop(0))
        return real(raw)

    monkeypatch.setattr(node.w3.eth, "send_raw_transaction", send)
    return refused


def _landed(node: Chain, tx: str) -> int:  # noqa: F811
    status = EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60)
    assert status is not None and status.state is TxState.SUCCEEDED
    return status.block


def test_a_refusal_after_the_record_is_filled_with_a_cancel_and_the_account_goes_on(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(5_000)
    payee = Account.create().address
    records: list[tuple[str, str, int]] = []
    _refuse(node, monkeypatch, "transaction would cause overdraft")
    first = node.claim(buyer, payee, 2_000, "refused")
    with pytest.raises(LeftOpen):
        _submit(node, [account], first, records)
    assert [(a, n) for _, a, n in records] == [(account.address, start)]
    assert node.w3.eth.get_transaction_count(account.address) == start + 1  # the cancel took the nonce
    assert node.balance(payee) == 0
    # A later settlement on the same account, same process: mined at the next nonce.
    later = _submit(node, [account], node.claim(buyer, payee, 3_000, "later"), records)
    assert records[-1] == (later, account.address, start + 1)
    _landed(node, later)
    # The refused settlement's retry: its recorded nonce is consumed (the cancel), so a new one is safe.
    again = _submit(node, [account], _retry_of(first, records[0]), records)
    assert records[-1] == (again, account.address, start + 2)
    _landed(node, again)
    assert node.balance(payee) == 5_000 and node.balance(buyer.address) == 0
    assert node.w3.eth.get_transaction_count(account.address) == start + 3


def test_an_underpriced_refusal_re_signs_the_transfer_at_the_same_nonce(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(2_000)
    payee = Account.create().address
    records: list[tuple[str, str, int]] = []
    refused = _refuse(node, monkeypatch, "transaction underpriced")
    tx = _submit(node, [account], node.claim(buyer, payee, 2_000, "underpriced"), records)
    assert len(refused) == 1
    assert [(a, n) for _, a, n in records] == [(account.address, start)] * 2  # the same nonce, recorded again
    assert records[0][0] != tx == records[1][0]
    _landed(node, tx)
    assert node.balance(payee) == 2_000 and node.balance(buyer.address) == 0
    assert node.w3.eth.get_transaction_count(account.address) == start + 1


def test_a_nonce_whose_fill_failed_is_filled_by_the_repair_step(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    """The transfer and its cancel both refused: the nonce is left to the repair step; a later settlement at the
    next nonce waits behind it until the repair fills it (no restart)."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(3_000)
    payee = Account.create().address
    records: list[tuple[str, str, int]] = []
    _refuse(node, monkeypatch, "txpool is full", "txpool is full")
    with pytest.raises(LeftOpen):
        _submit(node, [account], node.claim(buyer, payee, 1_000, "stalled"), records)
    assert node.w3.eth.get_transaction_count(account.address, "pending") == start  # a gap
    later = _submit(node, [account], node.claim(buyer, payee, 3_000, "behind"), records)
    assert records[-1] == (later, account.address, start + 1)
    assert node.w3.eth.get_transaction_count(account.address) == start  # it waits behind the gap
    pool = accounts_module._pools[NETWORK]
    pool.repair()  # as the pool's thread does every REPAIR_SECONDS
    _landed(node, later)
    _until(lambda: node.w3.eth.get_transaction_count(account.address) == start + 2)
    assert node.balance(payee) == 3_000


def test_a_failed_record_leaves_no_shared_nonce(node: Chain):  # noqa: F811
    """before_broadcast raised (maybe after a commit): the nonce is filled with a cancel, never handed out again."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(1_000)
    payee = Account.create().address
    seen: list[int] = []

    def record(tx: str, address: str, nonce: int) -> None:
        seen.append(nonce)
        if len(seen) == 1:
            raise RuntimeError("commit lost")

    from backend.rails.evm import sender

    with pytest.raises(RuntimeError):
        sender.submit(node.network, node.claim(buyer, payee, 1_000, "a"), [account], node.redis, record)
    tx = sender.submit(node.network, node.claim(buyer, payee, 1_000, "b"), [account], node.redis, record).tx_id
    assert seen == [start, start + 1]
    _landed(node, tx)
    assert node.balance(payee) == 1_000
    assert node.w3.eth.get_transaction_count(account.address) == start + 2


def _retry_of(claim: Any, record: tuple[str, str, int]) -> Any:
    return dataclasses.replace(claim, tx_id=record[0], relay_address=record[1], relay_nonce=record[2])


def test_a_dropped_settlement_after_a_restart_waits_for_its_nonce_and_settles_once(node: Chain):  # noqa: F811
    """Its transaction dropped by the node and the process restarted (no signed bytes): no second transaction at a
    new nonce while the recorded one is unconsumed (watch: PENDING, not held; the submit leaves it open while
    another process owns the account); once this process owns the account, the transfer is re-signed at that
    nonce (the start, leased for this retry, leaves the nonce to it: no cancel first) and settles exactly once."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    other = node.relay_account()
    buyer = node.buyer(1_000)
    payee = Account.create().address
    records: list[tuple[str, str, int]] = []
    node.rpc("evm_setAutomine", False)
    first = node.claim(buyer, payee, 1_000, "dropped")
    _submit(node, [account], first, records)
    node.rpc("anvil_dropTransaction", records[0][0])
    _reset()  # a restart: no pool, no watcher, no signed bytes
    retry = _retry_of(first, records[0])
    status = EVM_RAIL.watch(node.network, [retry])[retry.tx_id]
    assert status.state is TxState.PENDING and not status.held  # never UNKNOWN: not released, no new nonce
    lease = relay.LEASE_KEY.format(NETWORK, account.address)
    node.redis.set(lease, b"another-process", ex=30)
    with pytest.raises(LeftOpen) as left:
        _submit(node, [account, other], retry, records)
    assert left.value.result == "waiting-for-chain" and len(records) == 1
    assert node.w3.eth.get_transaction_count(account.address, "pending") == start  # nothing sent
    assert node.w3.eth.get_transaction_count(other.address, "pending") == 0
    node.redis.delete(lease)  # the other process is gone
    _reset()
    tx = _submit(node, [account], retry, records, lambda n, a: start)
    assert records[-1] == (tx, account.address, start) and tx != records[0][0]
    node.rpc("evm_mine")
    _landed(node, tx)
    assert node.balance(payee) == 1_000 and node.balance(buyer.address) == 0
    assert node.w3.eth.get_transaction_count(account.address) == start + 1


def test_the_owner_re_signs_a_dropped_settlement_at_its_recorded_nonce(node: Chain):  # noqa: F811
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(1_000)
    payee = Account.create().address
    records: list[tuple[str, str, int]] = []
    node.rpc("evm_setAutomine", False)
    first = node.claim(buyer, payee, 1_000, "resigned")
    _submit(node, [account], first, records)
    node.rpc("anvil_dropTransaction", records[0][0])
    pipeline.shared_watcher(node.chain).forget(records[0][0])  # its bytes gone (forgotten)
    tx = _submit(node, [account], _retry_of(first, records[0]), records)
    assert records[-1] == (tx, account.address, start) and tx != records[0][0]  # the same nonce, re-signed
    node.rpc("evm_mine")
    _landed(node, tx)
    assert node.balance(payee) == 1_000 and node.balance(buyer.address) == 0
    assert node.w3.eth.get_transaction_count(account.address) == start + 1


def test_a_lease_not_renewed_in_time_is_never_used_and_another_process_lease_is_left_alone(node: Chain):  # noqa: F811
    account = node.relay_account()
    buyer = node.buyer(1_000)
    payee = Account.create().address
    records: list[tuple[str, str, int]] = []
    _landed(node, _submit(node, [account], node.claim(buyer, payee, 1_000, "leased"), records))
    pool = accounts_module._pools[NETWORK]
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    pool._owned[account.address].valid_until = 0.0  # as if this process was paused past its lease
    node.redis.set(key, b"another-process", ex=30)  # which another process took meanwhile
    with pytest.raises(RelayUnavailable):
        pool.take(wait_seconds=0.3)  # not handed out again, and not leased over the other's
    assert account.address not in pool.owned()
    pool.release()  # compare-and-set: another's lease is neither extended nor deleted
    assert node.redis.get(key) == b"another-process" and 0 < node.redis.ttl(key) <= 30
    node.redis.delete(key)


def test_a_replacement_whose_fee_read_fails_leaves_its_nonce_to_the_repair_step(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    """Review H1 (evmfix): "underpriced", then the fee read of the re-sign fails (an RPC error) and so does the
    cancel's: the nonce went to no one (allocated for good) and the account stalled until a restart. Now it is
    left to the repair step, which fills it, and the settlement behind it is mined."""
    from backend.rails.evm import sender

    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(3_000)
    payee = Account.create().address
    records: list[tuple[str, str, int]] = []
    _refuse(node, monkeypatch, "transaction underpriced")
    failing = {"sender": 1, "accounts": 1}

    def flaky(where: str, real: Any) -> Any:
        def read(chain: Any) -> Any:
            if failing[where]:
                failing[where] -= 1
                raise ConnectionError("the RPC went away")
            return real(chain)

        return read

    # The first send's own fee read (the rail's submit) works; the re-sign's, after the refusal, fails.
    real_fees = sender.fees
    claim = node.claim(buyer, payee, 1_000, "replaced")

    def first_then_flaky(chain: Any) -> Any:
        monkeypatch.setattr(sender, "fees", flaky("sender", real_fees))
        return real_fees(chain)

    monkeypatch.setattr(sender, "fees", first_then_flaky)
    monkeypatch.setattr(accounts_module, "fees", flaky("accounts", accounts_module.fees))
    with pytest.raises((LeftOpen, ConnectionError)):
        _submit(node, [account], claim, records)
    assert failing == {"sender": 0, "accounts": 0}
    assert node.w3.eth.get_transaction_count(account.address, "pending") == start  # nothing at the nonce
    later = _submit(node, [account], node.claim(buyer, payee, 2_000, "behind"), records)
    assert records[-1] == (later, account.address, start + 1)
    accounts_module._pools[NETWORK].repair()  # as the pool's thread does every REPAIR_SECONDS
    _landed(node, later)
    _until(lambda: node.w3.eth.get_transaction_count(account.address) == start + 2)
    assert node.balance(payee) == 2_000


@pytest.mark.parametrize(
    ("answer", "held"),
    [
        ("already known", True),  # geth and its forks
        ("transaction already imported", True),  # Anvil
        ("Known transaction", True),  # Besu
        ("AlreadyKnown", True),  # Nethermind
        ("Transaction with the same hash was already imported.", True),  # OpenEthereum
        ("unknown transaction", False),
        ("replacement transaction underpriced", False),
        ("nonce too low", False),
        ("insufficient funds for gas * price + value", False),
        ("txpool is full", False),
    ],
)
def test_only_a_nodes_word_that_it_holds_the_very_transaction_counts_as_held(answer: str, held: bool):
    """A resend's answer that the node holds these bytes is not a refusal (no reclaim, no cancel); everything else
    is read as before (the regex must not take an "unknown transaction" or an underpriced refusal for it)."""
    assert relay.already_known(Web3RPCError(answer)) is held
    assert relay.already_known(ValueError({"code": -32000, "message": answer})) is held
