"""Relay-account leases through a stalled Redis, a release at exit and a reset broadcast (issue 16), on a real Anvil
with our TestUSDC and a real (private) Redis that the tests stop and resume (SIGSTOP / SIGCONT).

1. A Redis stall longer than the lease's validity gives every account up; once Redis answers again, the key that
   still holds this pool's own token is taken again at once (not after it lapses), and the renewer never hangs in
   one call for the length of the stall.
2. A release (the relayer's clean stop) waits for a broadcast under way from the account before freeing its key
   (bounded: one still under way keeps the key, which lapses by itself).
3. A broadcast whose connection is reset is tried again only while the lease is surely ours (web3's own retry of
   eth_sendRawTransaction would send it after the lease lapsed).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from redis import Redis

from backend.chains.evm import EvmChain
from backend.rails.evm import accounts as accounts_module
from backend.rails.evm import fence, relay
from backend.rails.evm.nonces import NonceManager
from harness.proxy import DropConnection, RpcProxy
from harness.redis_server import start_redis
from tests.rails.test_evm_pipeline import NETWORK, Chain, node  # noqa: F401
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)


@pytest.fixture
def stallable(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Redis]]:
    """A private redis-server (this test alone stops it) and a client of it."""
    proc, url = start_redis(tmp_path)
    try:
        yield proc, Redis.from_url(url)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def _stall(proc: subprocess.Popen[bytes], seconds: float) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    threading.Timer(seconds, os.kill, (proc.pid, signal.SIGCONT)).start()


def test_after_a_redis_stall_the_pool_takes_its_own_key_again_at_once(
    node: Chain,  # noqa: F811
    stallable: tuple[subprocess.Popen[bytes], Redis],
):
    proc, redis = stallable
    account = node.relay_account()
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    pool = accounts_module.AccountPool(redis, node.chain, [account], None, lease_seconds=8)  # valid 4 s of 8
    try:
        first = pool.take(wait_seconds=1)
        pool.renew()  # the last renewal before the stall: the key lasts 8 s from here
        _stall(proc, 5)
        time.sleep(4.5)
        assert not first.valid()  # no renewal for longer than its validity: given up
        began = time.monotonic()
        second = pool.take(wait_seconds=2)  # Redis answers again at 5 s; the key (8 s) is still there, ours
        assert second is not first and second.account.address == account.address
        assert time.monotonic() - began < 2 and second.valid() and redis.get(key) == pool.token
        assert 5 < (redis.pttl(key) / 1000) <= 8  # renewed by the take
        assert not first.valid()  # the old one stays given up
    finally:
        pool.release()


def test_the_renewer_gives_a_stalled_redis_call_up_and_tries_again(
    node: Chain,  # noqa: F811
    stallable: tuple[subprocess.Popen[bytes], Redis],
    monkeypatch: pytest.MonkeyPatch,
):
    """Each renewal's call fails after RENEW_TIMEOUT_SECONDS: a Redis that stops answering (a stall, a connection
    gone dead) never holds the renewer in one call past the lease."""
    proc, redis = stallable
    monkeypatch.setattr(accounts_module, "RENEW_TIMEOUT_SECONDS", 0.3)
    account = node.relay_account()
    pool = accounts_module.AccountPool(redis, node.chain, [account], None, lease_seconds=2)  # renewed every 0.5 s
    tries: list[float] = []
    real = pool.renew

    def renew() -> None:
        tries.append(time.monotonic())
        real()

    monkeypatch.setattr(pool, "renew", renew)
    try:
        pool.take(wait_seconds=1)
        stalled = time.monotonic()
        _stall(proc, 3)
        time.sleep(3)
        during = [t for t in tries if stalled < t < stalled + 3]
        assert len(during) >= 3  # one call hung for the whole stall would be one try
    finally:
        pool.release()


class _SlowSends(RpcProxy):
    """Forwards every call; each eth_sendRawTransaction reaches the node after ``delay`` seconds."""

    def __init__(self, upstream: str, delay: float) -> None:
        self.delay = delay
        self.arrived = threading.Event()
        super().__init__(upstream)

    def handle(self, body: Any) -> Any:
        if isinstance(body, dict) and body.get("method") == "eth_sendRawTransaction":
            self.arrived.set()
            time.sleep(self.delay)
        return self.forward(body)


def _via(node: Chain, url: str) -> EvmChain:  # noqa: F811
    return EvmChain(dataclasses.replace(node.network, rpc_url=url))


def _cancel(node: Chain, owned: fence.Owned) -> bytes:  # noqa: F811
    transaction = owned.manager.cancel_transaction(owned.manager.allocate(), relay.fees(node.chain))
    return bytes(owned.account.sign_transaction(transaction).raw_transaction)


def _broadcasting(chain: EvmChain, owned: fence.Owned, raw: bytes) -> threading.Thread:
    thread = threading.Thread(target=lambda: fence.broadcast(chain, owned, raw), daemon=True)
    thread.start()
    return thread


def test_a_release_waits_for_a_broadcast_under_way_before_freeing_the_key(node: Chain):  # noqa: F811
    account = node.relay_account()
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    start = node.w3.eth.get_transaction_count(account.address)
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    with _SlowSends(node.network.rpc_url or "", delay=1.0) as proxy:
        owned = pool.take(wait_seconds=1)
        sending = _broadcasting(_via(node, proxy.url), owned, _cancel(node, owned))
        assert proxy.arrived.wait(5)  # past its lease check, not at the node yet
        began = time.monotonic()
        pool.release()
        # Freed only once the node took it: another process leasing the key now cannot reuse its nonce unseen.
        assert node.w3.eth.get_transaction_count(account.address, "pending") == start + 1
        assert not node.redis.exists(key) and 0.5 < time.monotonic() - began < accounts_module.RELEASE_WAIT_SECONDS
        sending.join(5)
        assert not owned.valid()
        with pytest.raises(fence.LeaseLost):  # none starts after the release
            fence.broadcast(node.chain, owned, _cancel(node, owned))


def test_a_release_leaves_the_key_to_lapse_when_a_broadcast_outlasts_its_wait(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(accounts_module, "RELEASE_WAIT_SECONDS", 0.5)
    account = node.relay_account()
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    with _SlowSends(node.network.rpc_url or "", delay=3.0) as proxy:
        owned = pool.take(wait_seconds=1)
        sending = _broadcasting(_via(node, proxy.url), owned, _cancel(node, owned))
        assert proxy.arrived.wait(5)
        began = time.monotonic()
        pool.release()
        assert time.monotonic() - began < 1.5  # bounded
        assert node.redis.get(key) == pool.token and node.redis.ttl(key) > 0  # left to lapse, not freed
        sending.join(10)
    node.redis.delete(key)


def test_a_lease_taken_again_here_waits_for_the_lapsed_ones_broadcast_under_way(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    """Its own key taken again at once after a stall: the new start must not read the chain's count (and reuse a
    nonce) while a broadcast that passed the lapsed lease's check is still on its way to the node."""
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    with _SlowSends(node.network.rpc_url or "", delay=1.5) as proxy:
        try:
            first = pool.take(wait_seconds=1)
            monkeypatch.setattr(pool, "renew", lambda: True)  # no renewal from now on (Redis stalled)
            sending = _broadcasting(_via(node, proxy.url), first, _cancel(node, first))
            assert proxy.arrived.wait(5)
            first.valid_until = 0.0  # its validity ran out meanwhile; the key is still this pool's
            second = pool.take(wait_seconds=5)
            assert second is not first and node.redis.get(second.key) == pool.token
            assert node.w3.eth.get_transaction_count(account.address, "pending") == start + 1
            assert second.manager.next_nonce == start + 1  # not the nonce in flight
            sending.join(5)
        finally:
            pool.release()


class _ResetFirstSend(RpcProxy):
    """The first eth_sendRawTransaction is held ``hold`` seconds, then its connection is closed unanswered (never
    forwarded); later ones are forwarded. ``sends`` counts them."""

    def __init__(self, upstream: str, hold: float) -> None:
        self.hold = hold
        self.sends = 0
        super().__init__(upstream)

    def handle(self, body: Any) -> Any:
        if isinstance(body, dict) and body.get("method") == "eth_sendRawTransaction":
            self.sends += 1
            if self.sends == 1:
                time.sleep(self.hold)
                raise DropConnection
        return self.forward(body)


def _owned(node: Chain, valid_for: float) -> fence.Owned:  # noqa: F811
    account = node.relay_account()
    manager = NonceManager.for_chain(node.chain, account.address, node.redis)
    manager.start(None)
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    return fence.Owned(account, manager, key, valid_until=time.monotonic() + valid_for)


def test_a_reset_broadcast_is_not_sent_again_once_the_lease_lapsed(node: Chain):  # noqa: F811
    owned = _owned(node, valid_for=0.5)  # lapses while the first try is held
    start = node.w3.eth.get_transaction_count(owned.account.address)
    with _ResetFirstSend(node.network.rpc_url or "", hold=1.0) as proxy:
        with pytest.raises(requests.ConnectionError):  # the node may hold the first try: not LeaseLost
            fence.broadcast(_via(node, proxy.url), owned, _cancel(node, owned))
        time.sleep(0.5)  # web3's retry came 0.1 s after the reset
        assert proxy.sends == 1
    assert node.w3.eth.get_transaction_count(owned.account.address, "pending") == start


def test_a_reset_broadcast_is_sent_again_while_the_lease_is_ours(node: Chain):  # noqa: F811
    owned = _owned(node, valid_for=30)
    start = node.w3.eth.get_transaction_count(owned.account.address)
    with _ResetFirstSend(node.network.rpc_url or "", hold=0.2) as proxy:
        fence.broadcast(_via(node, proxy.url), owned, _cancel(node, owned))
        assert proxy.sends == 2
    assert node.w3.eth.get_transaction_count(owned.account.address, "pending") == start + 1
