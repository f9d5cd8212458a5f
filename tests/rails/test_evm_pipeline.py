"""The pipelined EVM relay on a real Anvil with our TestUSDC: the shared watcher (one batch per new head for every
waiter), many settlements from one relay account in one block, accounts leased per process, gaps filled at start,
a dropped transaction broadcast again; and what a settlement costs in RPC calls before and after.

Each test uses relay accounts of its own (``anvil_setBalance``), never the devnet's, so no relayer of another test
leases them; mining is paused where a test needs many transactions in one block, and the chain is put back after.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from eth_account import Account
from eth_account.signers.local import LocalAccount
from redis import Redis
from web3 import Web3

from backend.chains.evm import domain_name, evm_chain
from backend.rails.base import CannotSucceed, Claim, LeftOpen, RelayNonceTaken, TxState
from backend.rails.evm import accounts as accounts_module
from backend.rails.evm import pipeline, relay, sender, watch
from backend.rails.evm.rail import EVM_RAIL
from backend.rails.evm.relay import RelayUnavailable
from payintent.eip3009 import sign_authorization
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)
from tests.settlement.test_recovery import _send_as, _token

NETWORK = "eip155:84532"


class Chain:
    def __init__(self, devnet: Any, redis_url: str) -> None:  # noqa: F811
        self.devnet = devnet
        self.network = devnet.chains.get(NETWORK)
        self.chain = evm_chain(self.network)
        self.w3: Web3 = self.chain.w3
        self.redis = Redis.from_url(redis_url)
        self.redis_url = redis_url
        self.w3_token = _token(devnet, NETWORK)[1]

    def rpc(self, method: str, *params: Any) -> Any:
        response = self.w3.provider.make_request(method, list(params))  # type: ignore[arg-type]
        assert "error" not in response, (method, response)
        return response["result"]

    def relay_account(self) -> LocalAccount:
        account: LocalAccount = Account.create()
        self.rpc("anvil_setBalance", account.address, hex(10**20))
        return account

    def buyer(self, amount: int) -> LocalAccount:
        buyer: LocalAccount = Account.create()
        _send_as(self.w3, self.devnet.buyer(1), self.w3_token.functions.transfer(buyer.address, amount))
        return buyer

    def claim(self, buyer: LocalAccount, pay_to: str, amount: int, name: str) -> Claim:
        extra = {"name": domain_name(self.network), "version": self.network.usdc_domain_version}
        requirement = {"network": NETWORK, "asset": self.network.usdc_address, "payTo": pay_to,
                       "maxAmountRequired": str(amount), "extra": extra}  # fmt: skip
        auth = sign_authorization(buyer.key, requirement)
        terms = EVM_RAIL.terms_from_columns(
            {"payer": auth["from"], "pay_to": auth["to"], "amount_atomic": amount, "valid_after": 0,
             "valid_before": int(auth["validBefore"]), "nonce": auth["nonce"], "signature": auth["signature"]}
        )  # fmt: skip
        return Claim(name, name, self.network.usdc_address, terms, None, None, None)

    def balance(self, address: str) -> int:
        return int(self.w3_token.functions.balanceOf(address).call())


@pytest.fixture
def node(devnet: Any, redis_server_url: str) -> Iterator[Chain]:  # noqa: F811
    """The devnet chain with fresh process-wide watchers and account pools (as a new relayer process has)."""
    control = Chain(devnet, redis_server_url)
    _reset()
    try:
        yield control
    finally:
        _reset()
        control.rpc("evm_setAutomine", True)


def _reset() -> None:
    for watcher in pipeline._watchers.values():
        watcher.stop()
    pipeline._watchers.clear()
    for pool in accounts_module._pools.values():
        pool.release()
    accounts_module._pools.clear()


def _submit(node: Chain, accounts: list[LocalAccount], claim: Claim, records: list[tuple[str, str, int]],
            recorded: Any = None) -> str:  # fmt: skip
    submission = sender.submit(node.network, claim, accounts, node.redis,
                               lambda tx, address, nonce: records.append((tx, address, nonce)), recorded)  # fmt: skip
    return submission.tx_id


def test_concurrent_waiters_share_one_batch_per_new_head(node: Chain):
    """16 jobs wait on transactions mined in one block: the watcher reads their receipts in ONE batch."""
    account = node.relay_account()
    watcher = pipeline.shared_watcher(node.chain)
    node.rpc("evm_setAutomine", False)
    base = node.w3.eth.get_transaction_count(account.address)
    chain_id = node.network.chain_id
    txs = [{"to": account.address, "value": 0, "gas": 21_000, "gasPrice": 2 * 10**9, "nonce": base + i,
            "chainId": chain_id} for i in range(16)]  # fmt: skip
    raws = [account.sign_transaction(tx) for tx in txs]
    hashes = ["0x" + bytes(raw.hash).hex() for raw in raws]
    results: dict[str, Any] = {}

    def job(i: int) -> None:
        watcher.expect(hashes[i], bytes(raws[i].raw_transaction))
        node.w3.eth.send_raw_transaction(raws[i].raw_transaction)
        results[hashes[i]] = EVM_RAIL.wait_landed(node.network, _claim_of(hashes[i]), 60)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    _until(lambda: len(watcher.blocks.tracked()) == 16 and watcher.blocks.head is not None)
    pipeline_poll_settles(watcher)
    before = watcher.blocks.counter.snapshot()
    block = int(node.rpc("evm_mine") and node.w3.eth.block_number)
    for thread in threads:
        thread.join(timeout=60)
    calls, round_trips, batches = (b - a for a, b in zip(before, watcher.blocks.counter.snapshot(), strict=True))
    assert batches == 1  # one batch for the new head, whatever the number of waiters
    # That batch held the 16 receipts and the head again (BlockWatcher judges depth by the lower of the poll's head
    # and the batch's own: 17 calls, one round trip); every other call was a lone head read (one call, one trip).
    assert calls - round_trips == 16 + 1 - 1
    assert {(s.state, s.block) for s in results.values()} == {(TxState.SUCCEEDED, block)}
    assert len(results) == 16


def _claim_of(tx_hash: str) -> Claim:
    return Claim("s", "i", "", None, tx_hash, None, None)  # type: ignore[arg-type]


def pipeline_poll_settles(watcher: pipeline.SharedWatcher) -> None:
    """Wait until a poll round read the freshly tracked hashes (the forced read): the next batch is the head's."""
    _until(lambda: not watcher._new)
    head_reads = watcher.blocks.counter.calls
    _until(lambda: watcher.blocks.counter.calls > head_reads + 1)


def _until(condition: Any, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sixteen_settlements_from_one_account_in_one_block(node: Chain):
    account = node.relay_account()
    buyer = node.buyer(16 * 1_000)
    payees = [Account.create().address for _ in range(16)]
    claims = [node.claim(buyer, payees[i], 1_000 + i * 0, f"s{i}") for i in range(16)]
    start = node.w3.eth.get_transaction_count(account.address)
    node.rpc("evm_setAutomine", False)
    records: list[tuple[str, str, int]] = []
    sent: dict[int, str] = {}
    errors: list[BaseException] = []

    def job(i: int) -> None:
        try:
            sent[i] = _submit(node, [account], claims[i], records)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and len(sent) == 16
    node.rpc("evm_mine")
    block = int(node.w3.eth.block_number)
    statuses = [EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60) for tx in sent.values()]

    assert sorted(nonce for _, _, nonce in records) == list(range(start, start + 16))  # consecutive, none twice
    assert {address for _, address, _ in records} == {account.address}
    assert {(s.state, s.block) for s in statuses if s is not None} == {(TxState.SUCCEEDED, block)}
    assert len(statuses) == 16
    assert [node.balance(payee) for payee in payees] == [1_000] * 16  # each paid once, on chain
    assert node.balance(buyer.address) == 0
    assert node.w3.eth.get_transaction_count(account.address) == start + 16


def test_two_processes_never_use_the_same_account(node: Chain):
    accounts = [node.relay_account(), node.relay_account()]
    first = accounts_module.AccountPool(node.redis, node.chain, accounts, None, lease_seconds=2)
    second = accounts_module.AccountPool(node.redis, node.chain, accounts, None, lease_seconds=2)
    third = accounts_module.AccountPool(node.redis, node.chain, accounts, None, lease_seconds=2)
    try:
        a = first.take().account.address
        b = second.take().account.address
        assert a != b
        import time

        time.sleep(3)  # past the lease's time to live: the renewals keep both
        with pytest.raises(RelayUnavailable):
            third.take(wait_seconds=1)
        assert first.take().account.address == a and second.take().account.address == b  # each keeps its own
        first.release()  # a clean stop frees its account at once
        assert third.take(wait_seconds=5).account.address == a
    finally:
        for pool in (first, second, third):
            pool.release()


def test_a_lease_gone_at_renewal_is_given_up_so_the_next_owner_fills_a_dead_processs_gap(node: Chain):
    """An idle process's lease key vanished (a Redis flush, or a short-lived process leased the account meanwhile and
    was gone before this one's next renewal); another process leased the account, recorded a nonce and died before
    broadcasting it. The idle process must not set the key again at its renewal (its nonce manager never saw that
    nonce, so its repair would never fill it): it gives the account up, and the next owner starts above the recorded
    nonce and fills it, so the dead process's settlement is not stuck behind an unfilled nonce."""
    account = node.relay_account()
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    gap: list[int] = []
    idle = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    crashed = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    later = accounts_module.AccountPool(node.redis, node.chain, [account], lambda network, address: gap[0])
    try:
        idle.take()
        node.redis.delete(key)  # gone: a Redis flush
        owned = crashed.take(wait_seconds=1)  # another process leases it meanwhile ...
        gap.append(owned.manager.allocate())  # ... records a nonce and dies before the broadcast
        crashed._stop.set()
        crashed._owned.clear()
        node.redis.delete(key)  # its lease expired
        idle.renew()
        assert idle.owned() == [] and node.redis.get(key) is None  # given up, not taken again
        taken = later.lease(account.address)
        assert taken is not None and taken.manager.next_nonce == gap[0] + 1
        deadline = time.monotonic() + 30
        while node.w3.eth.get_transaction_count(account.address, "latest") <= gap[0]:  # the gap's cancel is mined
            assert time.monotonic() < deadline, "the dead process's nonce was never filled"
            time.sleep(0.1)
        buyer, payee = node.buyer(1_000), Account.create().address
        records: list[tuple[str, str, int]] = []
        accounts_module._pools[NETWORK] = later  # the process's pool, which the submit uses
        tx = _submit(node, [account], node.claim(buyer, payee, 1_000, "after-the-gap"), records)
        status = EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60)
        assert status is not None and status.state is TxState.SUCCEEDED
        assert records == [(tx, account.address, gap[0] + 1)] and node.balance(payee) == 1_000
    finally:
        for pool in (idle, crashed, later):
            pool.release()


def test_a_restart_after_a_crash_fills_the_gap_and_the_account_goes_on(node: Chain):
    """A crash between the record and the broadcast left nonces start..start+2 recorded and never sent: the new
    process's manager starts above them and fills them with cancels, so later payments are mined."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(2_000)
    payee = Account.create().address
    records: list[tuple[str, str, int]] = []

    def recorded(network: str, address: str) -> int | None:
        assert (network, address) == (NETWORK, account.address)
        return start + 2

    tx = _submit(node, [account], node.claim(buyer, payee, 2_000, "after"), records, recorded)
    assert records == [(tx, account.address, start + 3)]
    status = EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60)
    assert status is not None and status.state is TxState.SUCCEEDED  # not stalled behind the gap
    assert node.balance(payee) == 2_000
    assert node.w3.eth.get_transaction_count(account.address) == start + 4
    for nonce in range(start, start + 3):  # the gaps: 0-value transactions to itself, mined before the payment
        found = _find_tx(node, account.address, nonce, status.block)
        assert found and found[0]["to"] == account.address and found[0]["value"] == 0


def _find_tx(node: Chain, address: str, nonce: int, last_block: int) -> list[Any]:
    for number in range(last_block, max(last_block - 10, 0), -1):
        block = node.w3.eth.get_block(number, full_transactions=True)
        found = [t for t in block["transactions"] if t["from"] == address and t["nonce"] == nonce]
        if found:
            return found
    return []


def test_a_dropped_transaction_is_broadcast_again_and_settles_once(node: Chain, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(pipeline.MISSING_ENV, "2")
    account = node.relay_account()
    buyer = node.buyer(3_000)
    payee = Account.create().address
    node.rpc("evm_setAutomine", False)
    records: list[tuple[str, str, int]] = []
    tx = _submit(node, [account], node.claim(buyer, payee, 3_000, "dropped"), records)
    node.rpc("anvil_dropTransaction", tx)
    assert node.w3.provider.make_request("eth_getTransactionByHash", [tx])["result"] is None  # type: ignore[arg-type]
    watcher = pipeline.shared_watcher(node.chain)
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60)))
    waiter.start()
    _until(lambda: tx.lower() in watcher.blocks.tracked())
    for _ in range(6):  # empty heads: the watcher says Missing, finds the node without it, and sends it again
        node.rpc("evm_mine")
        _until(lambda: watcher.blocks.head == int(node.w3.eth.block_number))
        if watcher.rebroadcasts:
            break
    assert watcher.rebroadcasts == 1
    node.rpc("evm_mine")
    waiter.join(timeout=60)
    assert result and result[0] is not None and result[0].state is TxState.SUCCEEDED
    assert len(records) == 1  # the same transaction: nothing recorded again
    assert node.balance(payee) == 3_000 and node.balance(buyer.address) == 0


class Counting:
    """Every JSON-RPC call this process posts (a batch counts each call in it) and its HTTP round trips: what web3
    and the batches send alike, at ``requests``' level."""

    def __init__(self) -> None:
        self.calls = self.round_trips = 0
        self.post = requests.Session.post

    def __enter__(self) -> Counting:
        counting = self

        def post(session: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
            body = kwargs.get("data") if kwargs.get("data") is not None else kwargs.get("json")
            parsed = json.loads(body) if isinstance(body, bytes | str) else body
            counting.calls += len(parsed) if isinstance(parsed, list) else 1
            counting.round_trips += 1
            return counting.post(session, url, *args, **kwargs)

        requests.Session.post = post  # type: ignore[method-assign]
        return self

    def __exit__(self, *_: Any) -> None:
        requests.Session.post = self.post  # type: ignore[method-assign]


def test_rpc_calls_per_settlement_before_and_after(node: Chain, capsys: pytest.CaptureFixture[str]):
    """Eight settlements from one account, sent and waited for concurrently: the old path (estimate, Redis lease,
    pending-count nonce, receipt polling per job) and the pipelined one (one check batch, local nonce, shared
    watcher). Printed for the report; the pipelined one must ask less."""
    n = 8
    measured: dict[str, tuple[int, int]] = {}
    for path in ("before", "after"):
        _reset()
        account = node.relay_account()
        buyer = node.buyer(n * 500)
        claims = [node.claim(buyer, Account.create().address, 500, f"{path}{i}") for i in range(n)]
        relay.fees(node.chain)  # the fee cache warm for both (it is read every 3 s at most)
        if path == "after":
            pipeline.shared_watcher(node.chain)
            accounts_module.account_pool(node.redis, node.chain, [account], None).take()  # started once per process
        with Counting() as counting:

            def job(claim: Claim, path: str = path, account: LocalAccount = account) -> None:
                if path == "before":
                    tx = relay.submit(node.network, claim, [account], node.redis, lambda *_: None).tx_id
                    receipt = watch.wait_receipt(node.chain, tx, 60)
                    assert receipt is not None and receipt["status"] == 1
                else:
                    tx = _submit(node, [account], claim, [])
                    status = EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60)
                    assert status is not None and status.state is TxState.SUCCEEDED

            threads = [threading.Thread(target=job, args=(claim,)) for claim in claims]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
        measured[path] = (counting.calls, counting.round_trips)
    with capsys.disabled():
        print(f"\nRPC per settlement (calls, round trips): "
              f"before {[v / n for v in measured['before']]}, after {[v / n for v in measured['after']]}")  # fmt: skip
    assert measured["after"][1] < measured["before"][1]


def test_a_retry_of_a_dropped_settlement_sends_its_own_transaction_again(node: Chain):
    """The job of a settlement whose transaction the node lost (UNKNOWN) sends the very same bytes at the same
    (account, nonce): nothing recorded again, one transaction mined."""
    account = node.relay_account()
    buyer = node.buyer(4_000)
    payee = Account.create().address
    node.rpc("evm_setAutomine", False)
    records: list[tuple[str, str, int]] = []
    claim = node.claim(buyer, payee, 4_000, "retried")
    tx = _submit(node, [account], claim, records)
    node.rpc("anvil_dropTransaction", tx)
    again = _submit(node, [account], Claim(**{**claim.__dict__, "tx_id": tx, "relay_address": account.address}),
                    records)  # fmt: skip
    assert again == tx and len(records) == 1
    node.rpc("evm_mine")
    status = EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60)
    assert status is not None and status.state is TxState.SUCCEEDED
    assert node.balance(payee) == 4_000


def test_the_checks_batch_keeps_the_refusals(node: Chain):
    """A payer with code and a transfer that would revert are final refusals; a validAfter the chain has not passed
    leaves the settlement open; none of them takes a nonce."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(1_000)
    payee = Account.create().address
    claim = node.claim(buyer, payee, 1_000, "paid")
    EVM_RAIL.wait_landed(node.network, _claim_of(_submit(node, [account], claim, [])), 60)
    with pytest.raises(CannotSucceed, match="would revert"):  # the authorization is used: the eth_call reverts
        _submit(node, [account], claim, [])
    other = node.buyer(1_000)
    node.rpc("anvil_setCode", other.address, "0xef0100" + "11" * 20)
    with pytest.raises(CannotSucceed) as refused:
        _submit(node, [account], node.claim(other, payee, 1_000, "code"), [])
    assert refused.value.code == "PAYER_HAS_CODE"
    node.rpc("anvil_setCode", other.address, "0x")
    late = node.claim(other, payee, 1_000, "late")
    late = Claim(**{**late.__dict__, "terms": dataclasses.replace(late.terms, valid_after=2**40)})
    with pytest.raises(LeftOpen) as left:
        _submit(node, [account], late, [])
    assert left.value.result == "not-yet-valid"
    assert node.w3.eth.get_transaction_count(account.address) == start + 1  # only the payment took a nonce
    assert accounts_module._pools[NETWORK].take().manager.allocate() == start + 1  # no nonce left behind
    assert node.balance(payee) == 1_000 and node.balance(other.address) == 1_000


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread killed
def test_a_dead_watcher_thread_is_started_again_and_a_waiter_keeps_its_timeout(
    node: Chain, monkeypatch: pytest.MonkeyPatch
):
    import time

    watcher = pipeline.shared_watcher(node.chain)
    real = watcher.poll_once
    died: list[bool] = []

    def dying() -> None:
        if not died:
            died.append(True)
            raise SystemExit  # not an Exception: the thread ends
        real()

    monkeypatch.setattr(watcher, "poll_once", dying)
    watcher.ensure_running()
    _until(lambda: died and watcher._thread is not None and not watcher._thread.is_alive())
    began = time.monotonic()
    assert watcher.wait("0x" + "ab" * 32, 1.0) is None  # never sent: None at its timeout, not later
    assert time.monotonic() - began < 5
    assert watcher._thread is not None and watcher._thread.is_alive()  # started again by the waiter
    account = node.relay_account()
    signed = account.sign_transaction({"to": account.address, "value": 0, "gas": 21_000, "gasPrice": 2 * 10**9,
                                       "nonce": 0, "chainId": node.network.chain_id})  # fmt: skip
    tx_hash = "0x" + bytes(node.w3.eth.send_raw_transaction(signed.raw_transaction)).hex()
    status = EVM_RAIL.wait_landed(node.network, _claim_of(tx_hash), 30)
    assert status is not None and status.state is TxState.SUCCEEDED


def test_a_nonce_another_open_settlement_recorded_is_neither_broadcast_nor_cancelled(
    node: Chain, monkeypatch: pytest.MonkeyPatch
):
    """Two processes believe they own the account (a lease lost unseen): the other one sent the first payment at
    nonce n; this one, whose manager is stale, signs the second at n too. The record fails (the unique index over
    open rows, migration 0012: ``RelayNonceTaken``, raised here by the callback): nothing is broadcast at n, no
    cancel either (fees have risen, so a cancel would have replaced the first payment), and the account is given
    up. The first payment is mined and paid once; the second stays open, unpaid."""
    account = node.relay_account()
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    buyer = node.buyer(2_000)
    first_payee, second_payee = Account.create().address, Account.create().address
    mine = accounts_module.account_pool(node.redis, node.chain, [account], None)
    mine.take()  # this process: next nonce n
    node.redis.delete(key)  # gone (a Redis flush) before this process's next renewal
    theirs = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    node.rpc("evm_setAutomine", False)
    try:
        accounts_module._pools[NETWORK] = theirs  # the other process sends the first payment at n
        first: list[tuple[str, str, int]] = []
        tx = _submit(node, [account], node.claim(buyer, first_payee, 1_000, "first"), first)
        accounts_module._pools[NETWORK] = mine
        nonce = first[0][2]
        real_fees = accounts_module.fees
        monkeypatch.setattr(accounts_module, "fees", lambda chain: {k: 2 * v for k, v in real_fees(chain).items()})
        second: list[tuple[str, str, int]] = []

        def taken(tx_hash: str, address: str, at: int) -> None:
            second.append((tx_hash, address, at))
            if at == nonce:
                raise RelayNonceTaken(f"nonce {at} is another settlement's")

        with pytest.raises(LeftOpen) as refused:
            sender.submit(node.network, node.claim(buyer, second_payee, 1_000, "second"), [account], node.redis,
                          taken)  # fmt: skip
        assert refused.value.result == "lease-lost" and [at for _, _, at in second] == [nonce]
        assert mine.owned() == []  # given up
        assert node.w3.eth.get_transaction_count(account.address, "pending") == nonce + 1  # only the first is held
        node.rpc("evm_mine")
        status = EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60)
        assert status is not None and status.state is TxState.SUCCEEDED
        assert node.balance(first_payee) == 1_000 and node.balance(second_payee) == 0
        assert node.balance(buyer.address) == 1_000
    finally:
        node.rpc("evm_setAutomine", True)
        theirs.release()


def test_a_retry_never_replaces_another_transaction_at_its_recorded_nonce(node: Chain):
    """A settlement's retry sends again only its own transaction at its recorded (account, nonce), or replaces a
    cancel of ours there: a transfer of another settlement in flight at that nonce is left alone (waiting-for-chain),
    so the first payment is mined and the retried one is not sent."""
    account = node.relay_account()
    buyer = node.buyer(2_000)
    first_payee, second_payee = Account.create().address, Account.create().address
    node.rpc("evm_setAutomine", False)
    try:
        first: list[tuple[str, str, int]] = []
        tx = _submit(node, [account], node.claim(buyer, first_payee, 1_000, "first"), first)
        nonce = first[0][2]
        retried = dataclasses.replace(node.claim(buyer, second_payee, 1_000, "second"), tx_id="0x" + "ab" * 32,
                                      relay_address=account.address, relay_nonce=nonce)  # fmt: skip
        second: list[tuple[str, str, int]] = []
        with pytest.raises(LeftOpen) as refused:
            _submit(node, [account], retried, second)
        assert refused.value.result == "waiting-for-chain" and second == []
        node.rpc("evm_mine")
        status = EVM_RAIL.wait_landed(node.network, _claim_of(tx), 60)
        assert status is not None and status.state is TxState.SUCCEEDED
        assert node.balance(first_payee) == 1_000 and node.balance(second_payee) == 0
    finally:
        node.rpc("evm_setAutomine", True)


def test_the_start_never_cancels_a_transaction_the_node_holds_queued_behind_a_gap(
    node: Chain, monkeypatch: pytest.MonkeyPatch
):
    """A crashed process recorded nonce n (never sent) and sent a payment at n + 1, which the node holds queued
    behind the missing n. The next owner's start fills n with a cancel and leaves n + 1 alone, though fees have
    risen (a cancel there would have replaced the payment): the payment is mined at n + 1 and paid once."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(1_000)
    payee = Account.create().address
    claim = node.claim(buyer, payee, 1_000, "queued")
    signed = relay.sign_transfer(node.chain, relay.transfer_call(node.chain, claim.terms), account, start + 1,
                                 relay.fees(node.chain))  # fmt: skip
    queued = "0x" + bytes(signed.hash).hex()
    node.w3.eth.send_raw_transaction(signed.raw_transaction)
    assert node.w3.eth.get_transaction_count(account.address, "pending") == start  # queued behind the gap
    real_fees = accounts_module.fees
    monkeypatch.setattr(accounts_module, "fees", lambda chain: {k: 2 * v for k, v in real_fees(chain).items()})
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], lambda network, address: start + 1)
    node.rpc("evm_setAutomine", False)  # the start's fills wait in the pool with the queued payment
    try:
        owned = pool.take()
        assert owned.manager.next_nonce == start + 2
        node.rpc("evm_setAutomine", True)
        node.rpc("evm_mine")
        status = EVM_RAIL.wait_landed(node.network, _claim_of(queued), 60)
        assert status is not None and status.state is TxState.SUCCEEDED  # the queued payment itself
        assert node.balance(payee) == 1_000 and node.balance(buyer.address) == 0
        filled = _find_tx(node, account.address, start, status.block)
        assert filled and filled[0]["to"] == account.address and filled[0]["value"] == 0  # the gap: a cancel
        assert node.w3.eth.get_transaction_count(account.address) == start + 2
    finally:
        node.rpc("evm_setAutomine", True)
        pool.release()


def test_an_idle_watcher_thread_leaves_and_the_next_transaction_starts_it_again(
    node: Chain, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(pipeline, "IDLE_EXIT_SECONDS", 0.3)
    watcher = pipeline.shared_watcher(node.chain)
    watcher.ensure_running()
    first = watcher._thread
    assert first is not None
    _until(lambda: not first.is_alive(), timeout=10)  # nothing to watch: it left, and made no call after that
    assert watcher._thread is None
    calls = watcher.blocks.counter.calls
    time.sleep(0.5)
    assert watcher.blocks.counter.calls == calls
    account = node.relay_account()
    signed = account.sign_transaction({"to": account.address, "value": 0, "gas": 21_000, "gasPrice": 2 * 10**9,
                                       "nonce": 0, "chainId": node.network.chain_id})  # fmt: skip
    tx_hash = "0x" + bytes(node.w3.eth.send_raw_transaction(signed.raw_transaction)).hex()
    status = EVM_RAIL.wait_landed(node.network, _claim_of(tx_hash), 30)  # started again by the waiter
    assert status is not None and status.state is TxState.SUCCEEDED
    assert watcher._thread is not None and watcher._thread is not first


def test_a_watcher_whose_rpc_is_gone_warns_once_and_backs_off_until_someone_waits(
    node: Chain, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    import logging

    from harness.ports import free_port

    gone = evm_chain(dataclasses.replace(node.network, rpc_url=f"http://127.0.0.1:{free_port()}"))  # nothing listens
    watcher = pipeline.SharedWatcher(gone, poll_seconds=0.05)
    try:
        with caplog.at_level(logging.DEBUG, logger=pipeline.__name__):
            watcher.expect("0x" + "cd" * 32)  # sent, nobody waits (a waiter that timed out)
            time.sleep(2.0)
            rounds = watcher.blocks.counter.calls
            # Backing off: 0.1, 0.2, 0.4, 0.8 s... (about 40 rounds at the poll interval in 2 s).
            assert 3 <= rounds <= 8, rounds
            ours = [r for r in caplog.records if r.name == pipeline.__name__]
            warnings = [r for r in ours if r.levelno >= logging.WARNING]
            assert len(warnings) == 1 and "ConnectionError" in warnings[0].getMessage(), warnings
            # A waiter ends the back-off (now at 5 s: no read at all in the next 2 s without one): the node is read
            # at the poll interval again while it waits (a failed read takes about 0.15 s: the client tries a refused
            # connection twice, 0.1 s apart; 2 s leaves room for a loaded machine, where 1 s once saw only 2 reads).
            assert watcher.wait("0x" + "ef" * 32, 2.0) is None
            assert watcher.blocks.counter.calls - rounds >= 3
        assert len([r for r in caplog.records if r.name == pipeline.__name__ and r.levelno >= logging.WARNING]) == 1
    finally:
        watcher.stop()


def test_a_watcher_thread_started_after_idle_counts_heads_from_the_new_head_not_the_old(
    node: Chain, monkeypatch: pytest.MonkeyPatch
):
    """After an idle exit, blocks mined meanwhile are not heads a new transaction waited through: counted from the
    head its thread last saw, a transaction tracked then was reported missing (and its node asked, or it broadcast
    again) in its first round."""
    from backend.rails.evm.blocks import DEFAULT_MISSING_AFTER

    monkeypatch.setattr(pipeline, "IDLE_EXIT_SECONDS", 0.3)
    watcher = pipeline.shared_watcher(node.chain)
    watcher.ensure_running()
    _until(lambda: watcher.blocks.head is not None)
    _until(lambda: watcher._thread is None, timeout=10)  # nothing to watch: it left
    node.rpc("anvil_mine", hex(DEFAULT_MISSING_AFTER + 5))
    missing: list[str] = []
    monkeypatch.setattr(watcher, "_missing", missing.append)
    node.rpc("evm_setAutomine", False)  # the transaction waits in the pool: no receipt (set back by the fixture)
    account = node.relay_account()
    signed = account.sign_transaction({"to": account.address, "value": 0, "gas": 21_000, "gasPrice": 2 * 10**9,
                                       "nonce": 0, "chainId": node.network.chain_id})  # fmt: skip
    tx_hash = "0x" + bytes(node.w3.eth.send_raw_transaction(signed.raw_transaction)).hex()
    watcher.expect(tx_hash)
    _until(lambda: tx_hash in watcher.blocks.tracked() and watcher.blocks.head is not None)
    rounds = watcher.blocks.counter.calls
    _until(lambda: watcher.blocks.counter.calls >= rounds + 3)  # a few more rounds on the new head
    assert missing == []
    node.rpc("evm_mine")
    assert watcher.wait(tx_hash, 30) is not None
