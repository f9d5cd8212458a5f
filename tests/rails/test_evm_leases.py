"""The relay-account lease around every broadcast, on a real Anvil with our TestUSDC (review 2 of `pipe`).

M-3: every broadcast from a leased account (the first send, the "underpriced" replacement, a cancel, the raw resend of
a retry, the repair's and the start's fills) checks that this process still surely holds the lease right before it.
M-2: the renewer does nothing but renew (a slow repair never lets a lease lapse), and an account's start runs outside
the pool's lock (a slow start never blocks the settlement threads). M-1: a dead relayer's account with a transaction
queued behind a nonce it never broadcast is adopted by a live relayer, whose start fills the gap: the payment lands.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from eth_account import Account

from backend.rails.base import Claim, LeftOpen
from backend.rails.evm import accounts as accounts_module
from backend.rails.evm import pipeline, relay, sender
from backend.rails.evm.relay import RelayUnavailable
from tests.rails.test_evm_pipeline import NETWORK, Chain, _until, node  # noqa: F401
from tests.rails.test_evm_refusals import _refuse
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)


def _lapse(node: Chain, address: str) -> None:  # noqa: F811
    """This process's lease of ``address`` not renewed in time, and taken by another process meanwhile."""
    accounts_module._pools[NETWORK]._owned[address].valid_until = 0.0
    node.redis.set(relay.LEASE_KEY.format(NETWORK, address), b"another-process", ex=30)


def _submit(node: Chain, accounts: list[Any], claim: Claim, record: Any, recorded: Any = None) -> str:  # noqa: F811
    return sender.submit(node.network, claim, accounts, node.redis, record, recorded).tx_id


def test_an_underpriced_replacement_is_not_broadcast_once_the_lease_lapsed(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer, payee = node.buyer(2_000), Account.create().address
    records: list[tuple[str, str, int]] = []

    def record(tx: str, address: str, nonce: int) -> None:
        records.append((tx, address, nonce))
        if len(records) == 2:  # the replacement's record waited (a row lock) past the lease
            _lapse(node, address)

    _refuse(node, monkeypatch, "transaction underpriced")
    with pytest.raises(LeftOpen) as left:
        _submit(node, [account], node.claim(buyer, payee, 2_000, "replaced"), record)
    assert left.value.result == "lease-lost"
    assert [n for _, _, n in records] == [start, start]
    assert node.w3.eth.get_transaction_count(account.address, "pending") == start  # nothing sent (automine)
    assert node.balance(payee) == 0 and node.balance(buyer.address) == 2_000
    node.redis.delete(relay.LEASE_KEY.format(NETWORK, account.address))


def test_a_cancel_is_not_broadcast_once_the_lease_lapsed(node: Chain):  # noqa: F811
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer = node.buyer(1_000)

    def record(tx: str, address: str, nonce: int) -> None:
        _lapse(node, address)
        raise RuntimeError("the commit failed after the lease lapsed")

    with pytest.raises(RuntimeError):
        _submit(node, [account], node.claim(buyer, Account.create().address, 1_000, "failed"), record)
    assert node.w3.eth.get_transaction_count(account.address, "pending") == start  # no cancel from here
    node.redis.delete(relay.LEASE_KEY.format(NETWORK, account.address))


def test_a_retry_does_not_resend_its_bytes_from_an_account_another_process_leased(node: Chain):  # noqa: F811
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer, payee = node.buyer(1_000), Account.create().address
    records: list[tuple[str, str, int]] = []
    node.rpc("evm_setAutomine", False)
    claim = node.claim(buyer, payee, 1_000, "dropped")
    tx = _submit(node, [account], claim, lambda *r: records.append(r))
    node.rpc("anvil_dropTransaction", tx)  # the node lost it; this process still has its bytes
    assert pipeline.shared_watcher(node.chain).raw_of(tx) is not None
    _lapse(node, account.address)
    accounts_module._pools[NETWORK].lost(account.address)
    retry = dataclasses.replace(claim, tx_id=tx, relay_address=account.address, relay_nonce=start)
    with pytest.raises(LeftOpen) as left:
        _submit(node, [account], retry, lambda *r: records.append(r))
    assert left.value.result == "waiting-for-chain"
    node.rpc("evm_mine")
    assert node.w3.eth.get_transaction_count(account.address) == start  # not sent from here
    assert node.balance(payee) == 0
    node.redis.delete(relay.LEASE_KEY.format(NETWORK, account.address))


def test_the_start_sends_no_cancel_once_its_lease_lapsed(node: Chain):  # noqa: F811
    """A start slower than the lease (a slow database read): the gaps it found are not cancelled from here."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)

    def slow_record(network: str, address: str) -> int:
        time.sleep(2.2)  # past the lease (2 s) and its margin
        node.redis.set(relay.LEASE_KEY.format(NETWORK, address), b"another-process", ex=30)  # taken meanwhile
        return start + 1  # two recorded nonces the node lacks

    pool = accounts_module.AccountPool(node.redis, node.chain, [account], slow_record, lease_seconds=2)
    try:
        assert pool.lease(account.address) is None
        assert node.w3.eth.get_transaction_count(account.address, "pending") == start  # no cancel sent
        assert node.redis.get(relay.LEASE_KEY.format(NETWORK, account.address)) == b"another-process"
    finally:
        pool.release()
        node.redis.delete(relay.LEASE_KEY.format(NETWORK, account.address))


def test_the_repair_stops_broadcasting_once_the_lease_lapsed(node: Chain):  # noqa: F811
    """Two nonces the node lacks; the lease lapses during the first fill: the second is not sent from here."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    try:
        owned = pool.take(wait_seconds=1)
        manager = owned.manager
        first, second = manager.allocate(), manager.allocate()
        manager.unfilled(first)
        manager.unfilled(second)
        real = manager.chain_count
        reads = []

        def count(block: Any = "pending") -> int:
            if block == "pending":
                reads.append(block)
            if len(reads) == 2:  # after the first fill: the lease lapsed meanwhile
                owned.valid_until = 0.0
            return real(block)

        manager.chain_count = count  # type: ignore[method-assign]
        pool.repair()  # as the repair thread does
        assert node.w3.eth.get_transaction_count(account.address, "pending") == start + 1  # the first only
    finally:
        pool.release()


def test_renewal_keeps_the_lease_while_a_repair_is_slow(node: Chain, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    account = node.relay_account()
    monkeypatch.setattr(accounts_module, "REPAIR_SECONDS", 0.2)
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None, lease_seconds=3)
    slow = threading.Event()

    def repair() -> None:
        slow.set()
        time.sleep(6)  # a node that answers slowly, for longer than the lease

    monkeypatch.setattr(pool, "repair", repair)
    try:
        owned = pool.take(wait_seconds=1)
        assert slow.wait(5)
        time.sleep(4)
        assert owned.valid() and pool.take(wait_seconds=0.5) is owned
    finally:
        pool.release()


def test_a_slow_start_does_not_block_the_settlement_threads(node: Chain):  # noqa: F811
    x, y = node.relay_account(), node.relay_account()
    started = threading.Event()

    def recorded(network: str, address: str) -> None:
        if address == y.address:
            started.set()
            time.sleep(3)  # a slow database read, inside Y's start
        return None

    pool = accounts_module.AccountPool(node.redis, node.chain, [x, y], recorded)
    try:
        assert pool.take(wait_seconds=1).account.address == x.address
        starting = threading.Thread(target=pool.lease, args=(y.address,))
        starting.start()
        assert started.wait(5)
        began = time.monotonic()
        assert pool.take(wait_seconds=1).account.address == x.address
        assert time.monotonic() - began < 1
        starting.join()
        assert sorted(pool.owned()) == sorted([x.address, y.address])
    finally:
        pool.release()


def test_a_dead_relayers_account_with_a_gap_is_adopted_and_its_queued_payment_lands(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    """Review M-1: a relayer killed with a transfer at N+1 broadcast and N never broadcast (allocated, not recorded)
    on account X; the restarted relayer leased Y. Within a few repair periods it adopts X (no live lease, a recorded
    nonce not mined), fills N, and the payment queued at N+1 lands."""
    monkeypatch.setattr(accounts_module, "REPAIR_SECONDS", 0.5)
    monkeypatch.setattr(accounts_module, "ADOPT_SECONDS", 0.5)
    x, y = node.relay_account(), node.relay_account()
    records: list[tuple[str, str, int]] = []

    def recorded(network: str, address: str) -> int | None:
        return max([n for _, a, n in records if a == address], default=None)

    dead = accounts_module.AccountPool(node.redis, node.chain, [x, y], recorded)
    owned = dead.take(wait_seconds=1)
    assert owned.account.address == x.address
    gap = owned.manager.allocate()  # a thread allocated it, then the process died before its record
    accounts_module._pools[NETWORK] = dead
    buyer, payee = node.buyer(1_000), Account.create().address
    _submit(node, [x, y], node.claim(buyer, payee, 1_000, "queued"), lambda *r: records.append(r))
    assert records[0][2] == gap + 1
    # SIGKILL: no renewal, no repair, no release; its key stays until it expires
    dead._stop.set()
    dead._owned.clear()
    accounts_module._pools.clear()
    restarted = accounts_module.AccountPool(node.redis, node.chain, [x, y], recorded)
    accounts_module._pools[NETWORK] = restarted
    assert restarted.take(wait_seconds=1).account.address == y.address
    node.redis.delete(relay.LEASE_KEY.format(NETWORK, x.address))  # the dead key expires
    assert node.balance(payee) == 0 and node.w3.eth.get_transaction_count(x.address) == gap
    _until(lambda: node.balance(payee) == 1_000, timeout=20)
    assert node.w3.eth.get_transaction_count(x.address) == gap + 2  # the gap's cancel, then the transfer
    assert node.balance(buyer.address) == 0
    # All mined: given back (free for any relayer), and never used here for new sends meanwhile.
    _until(
        lambda: x.address not in restarted.owned() and not node.redis.exists(relay.LEASE_KEY.format(NETWORK, x.address))
    )
    assert restarted.take(wait_seconds=1).account.address == y.address


def test_a_renewal_in_flight_does_not_revive_a_lease_given_up(node: Chain, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    """Review m-1: ``lost`` (RelayNonceTaken) while a renewal's compare-and-set is under way: still given up."""
    account = node.relay_account()
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    try:
        owned = pool.take(wait_seconds=1)
        real = pool._renew_key

        def renew_key(key: str) -> bool:
            renewed = real(key)  # the key is still ours...
            pool.lost(account.address)  # ...and a sender gave the account up meanwhile
            return renewed

        monkeypatch.setattr(pool, "_renew_key", renew_key)
        pool.renew()
        assert not owned.valid() and account.address not in pool.owned()
    finally:
        pool.release()
        node.redis.delete(relay.LEASE_KEY.format(NETWORK, account.address))


def test_the_repair_forgets_what_was_mined(node: Chain):  # noqa: F811
    """Review m-6: the manager's in-flight set and its cancels' hashes hold only what is not mined yet."""
    account = node.relay_account()
    buyer = node.buyer(1_000)

    def record(tx: str, address: str, nonce: int) -> None:
        if len(records) == 0:
            records.append((tx, address, nonce))
            raise RuntimeError("the commit failed")  # its nonce is filled with a cancel

    records: list[tuple[str, str, int]] = []
    with pytest.raises(RuntimeError):
        _submit(node, [account], node.claim(buyer, Account.create().address, 1_000, "cancelled"), record)
    _submit(node, [account], node.claim(buyer, Account.create().address, 1_000, "sent"), record)
    pool = accounts_module._pools[NETWORK]
    manager = pool._owned[account.address].manager
    assert len(manager.in_flight()) == 2 and len(manager._fills) == 1
    pool.repair()  # as the repair thread does
    assert manager.in_flight() == [] and manager._fills == set()


def test_concurrent_first_takes_lease_one_account(node: Chain):  # noqa: F811
    """The start runs outside the lock, yet settlement threads arriving together lease one account, not one each."""
    accounts = [node.relay_account() for _ in range(3)]
    pool = accounts_module.AccountPool(node.redis, node.chain, accounts, None)
    real = pool._lease

    def descheduled(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)  # each thread paused between its look at the pool and its lease attempt
        return real(*args, **kwargs)

    pool._lease = descheduled  # type: ignore[method-assign]
    try:
        taken: list[str] = []
        threads = [threading.Thread(target=lambda: taken.append(pool.take(wait_seconds=5).account.address))
                   for _ in range(8)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(taken) == 8 and len(set(taken)) == 1 and pool.owned() == [taken[0]]
    finally:
        pool.release()


# A relayer process: claims an identity slot of argv[2], leases the relay account of key argv[3] on the devnet's chain
# (chains file argv[1]), says so, and lives until killed.
_LEASING_RELAYER = """
import sys, time
from pathlib import Path
from eth_account import Account
from redis import Redis
from backend.chains.evm import evm_chain
from backend.chains.registry import ChainRegistry
from backend.rails.evm import accounts, identity
chain = evm_chain(ChainRegistry.load(sys.argv[1]).get(sys.argv[4]))
pool = accounts.AccountPool(Redis.from_url(sys.argv[5]), chain, [Account.from_key(sys.argv[3])], None,
                            identity=identity.claim(Path(sys.argv[2])))
print(pool.take(wait_seconds=5).account.address, flush=True)
time.sleep(600)
"""


def test_a_relayer_restarted_in_a_dead_ones_slot_takes_its_accounts_back_at_once(
    node: Chain,  # noqa: F811
    tmp_path: Path,
):
    """The drill's regression: a SIGKILLed relayer's accounts stayed leased for LEASE_SECONDS, so the relayers
    restarted after it found none free (4 accounts, a death every few seconds) and /pay timed out. A relayer that
    holds the dead one's identity slot (its flock, which the kernel freed at the death) takes them back at once; one
    in another slot never does while the holder lives (it may still broadcast)."""
    from backend.rails.evm import identity

    account = node.relay_account()
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    argv = [node.devnet.info["chains_file"], str(tmp_path), account.key.hex(), NETWORK, node.redis_url]
    child = subprocess.Popen([sys.executable, "-c", _LEASING_RELAYER, *argv], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().decode().strip() == account.address
        held = node.redis.get(key)
        # Alive: another slot, another identity; the account is not taken from it.
        other = accounts_module.AccountPool(node.redis, node.chain, [account], None, identity=identity.claim(tmp_path))
        with pytest.raises(RelayUnavailable):
            other.take(wait_seconds=1)
        assert node.redis.get(key) == held
        other.release()
        child.kill()  # SIGKILL: no release; the key stays for LEASE_SECONDS
        child.wait()
        assert node.redis.get(key) == held
        restarted = accounts_module.AccountPool(
            node.redis, node.chain, [account], None, identity=identity.claim(tmp_path)
        )  # the dead one's slot, now free
        try:
            began = time.monotonic()
            assert restarted.take(wait_seconds=2).account.address == account.address
            assert time.monotonic() - began < 2 and node.redis.get(key) == restarted.token
        finally:
            restarted.release()
        assert not node.redis.exists(key)  # a clean stop frees it for anyone
    finally:
        child.kill()
        child.wait()
        node.redis.delete(key)


def test_the_repair_sends_no_cancel_over_a_payment_the_node_already_holds(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    """The repair read the node's pending count just before a sender's broadcast landed: it finds that nonce ours in
    flight and sends the same bytes again. Anvil answers "transaction already imported" (geth "already known"): the
    payment is in the pool, not refused. It used to be taken for a refusal and the nonce filled with a cancel, which
    evicts the payment once fees have risen 10 % (seen in 3 of 8 blocks2-32 benchmark runs, then underpriced)."""
    account = node.relay_account()
    buyer, payee = node.buyer(1_000), Account.create().address
    node.rpc("evm_setAutomine", False)
    tx = _submit(node, [account], node.claim(buyer, payee, 1_000, "held"), lambda *r: None)
    pool = accounts_module._pools[NETWORK]
    manager = pool._owned[account.address].manager
    nonce = manager.next_nonce - 1
    real = manager.chain_count
    reads: list[int] = []

    def lagging(block: Any = "pending") -> int:  # the first pending count was read before the broadcast landed
        if block != "pending":
            return real(block)
        reads.append(nonce if not reads else real(block))
        return reads[-1]

    monkeypatch.setattr(manager, "chain_count", lagging)
    risen = {"maxPriorityFeePerGas": 50 * 10**9, "maxFeePerGas": 500 * 10**9}  # a cancel would replace the payment
    monkeypatch.setattr(accounts_module, "fees", lambda chain: risen)
    pool.repair()  # as the repair thread does
    assert reads[0] == nonce
    assert [flight.nonce for flight in manager.in_flight()] == [nonce]  # still ours in flight, not reclaimed
    assert manager._fills == set() and manager._unfilled == set()  # no cancel sent or owed
    node.rpc("evm_mine")
    assert node.w3.eth.get_transaction_receipt(tx)["status"] == 1
    assert node.balance(payee) == 1_000 and node.balance(buyer.address) == 0


def test_a_start_leaves_the_recorded_nonce_to_the_settlement_sent_again_there(node: Chain):  # noqa: F811
    """A dead relayer's settlement recorded at a nonce the node lacks (never broadcast), sent again by a live relayer
    that leases the account for it: the start fills no cancel there, the transfer goes at that nonce. The start used
    to cancel it and the transfer then replaced the cancel; a block mined between the two took the nonce with the
    cancel, and the payment waited for the reconciler (a CI failure of the reorg test, 1-second blocks)."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    buyer, payee = node.buyer(1_000), Account.create().address
    claim = node.claim(buyer, payee, 1_000, "recorded")
    never_sent = "0x" + "ab" * 32  # the dead relayer recorded it, then died before the broadcast
    retry = dataclasses.replace(claim, tx_id=never_sent, relay_address=account.address, relay_nonce=start)
    records: list[tuple[str, str, int]] = []
    sent = sender.submit(node.network, retry, [account], node.redis, lambda *r: records.append(r),
                         lambda network, address: start)  # fmt: skip
    assert (sent.relay_address, sent.relay_nonce) == (account.address, start)
    assert [nonce for _, _, nonce in records] == [start]
    assert node.w3.eth.get_transaction_receipt(sent.tx_id)["status"] == 1  # automine: mined at once
    assert node.w3.eth.get_transaction_count(account.address) == start + 1  # one transaction: no cancel before it
    assert node.balance(payee) == 1_000
    node.redis.delete(relay.LEASE_KEY.format(NETWORK, account.address))
