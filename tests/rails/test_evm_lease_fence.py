"""The lease fence's edges (the leases branch's second review), on a real Anvil and a real Redis:

1. The watcher's rebroadcast of a dropped transaction goes through ``fence.broadcast``: the lease is checked and
   the send counted right before the write, so a release waits for it, and none is sent once the lease is gone.
2. One renewal round that times out (a 1.5 s Redis stall) is tried again soon: the lease keeps its slack.
3. An account given back (or released) with a broadcast still under way is kept as retired: leasing it again here
   waits for that broadcast; a released pool leases nothing again.
4. A start whose last renewal raises leaves no orphan lease that may still send.
"""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import eth_utils
import pytest
from redis import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from backend.rails.evm import accounts as accounts_module
from backend.rails.evm import fence, relay
from backend.rails.evm.pipeline import SharedWatcher
from harness.proxy import RpcProxy
from tests.rails.test_evm_lease_stalls import _broadcasting, _cancel, _stall, _via, stallable  # noqa: F401
from tests.rails.test_evm_pipeline import NETWORK, Chain, node  # noqa: F401
from tests.settlement.conftest import devnet  # noqa: F401  (the session's devnet)


class _Slow(RpcProxy):
    """Forwards every call; ``method`` is answered after ``delay`` s (``arrived`` set when it comes); the time each
    eth_sendRawTransaction is forwarded is noted."""

    def __init__(self, upstream: str, method: str, delay: float) -> None:
        self.method, self.delay = method, delay
        self.arrived = threading.Event()
        self.sent_at: list[float] = []
        super().__init__(upstream)

    def handle(self, body: Any) -> Any:
        if isinstance(body, dict) and body.get("method") == self.method:
            self.arrived.set()
            time.sleep(self.delay)
        if isinstance(body, dict) and body.get("method") == "eth_sendRawTransaction":
            self.sent_at.append(time.monotonic())
        return self.forward(body)


class _Rebroadcast(threading.Thread):
    """A cancel signed and never sent (the node "dropped" it), expected by a watcher reading through ``proxy``;
    the thread runs the watcher's rebroadcast of it (``_missing``), keeping what it raised."""

    def __init__(self, node: Chain, proxy: _Slow, owned: fence.Owned) -> None:  # noqa: F811
        super().__init__(daemon=True)
        raw = _cancel(node, owned)
        self.tx_hash = "0x" + eth_utils.keccak(raw).hex()
        self.watcher = SharedWatcher(_via(node, proxy.url))
        self.watcher.expect(self.tx_hash, raw, owned)
        self.raised: list[BaseException] = []
        self.start()

    def run(self) -> None:
        try:
            self.watcher._missing(self.tx_hash)
        except BaseException as exc:
            self.raised.append(exc)


def test_the_watchers_rebroadcast_is_not_sent_once_a_release_freed_the_key(node: Chain):  # noqa: F811
    account = node.relay_account()
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    start = node.w3.eth.get_transaction_count(account.address)
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    with _Slow(node.network.rpc_url or "", "eth_getTransactionByHash", 2.0) as proxy:
        owned = pool.take(wait_seconds=1)
        rebroadcasting = _Rebroadcast(node, proxy, owned)
        assert proxy.arrived.wait(5)  # past the cheap look at the lease, asking the node for the hash
        pool.release()
        assert not node.redis.exists(key)  # free for any process now
        rebroadcasting.join(10)
        assert not rebroadcasting.raised and rebroadcasting.watcher.rebroadcasts == 0
        assert not proxy.sent_at  # the lease checked again right before the send
    assert node.w3.eth.get_transaction_count(account.address, "pending") == start


def test_a_release_waits_for_the_watchers_rebroadcast_under_way(node: Chain):  # noqa: F811
    account = node.relay_account()
    key = relay.LEASE_KEY.format(NETWORK, account.address)
    start = node.w3.eth.get_transaction_count(account.address)
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    with _Slow(node.network.rpc_url or "", "eth_sendRawTransaction", 1.0) as proxy:
        owned = pool.take(wait_seconds=1)
        rebroadcasting = _Rebroadcast(node, proxy, owned)
        assert proxy.arrived.wait(5)  # counted, on its way to the node
        pool.release()
        # Freed only once the node took it: another process leasing the key now cannot reuse its nonce unseen.
        assert node.w3.eth.get_transaction_count(account.address, "pending") == start + 1
        assert not node.redis.exists(key)
        rebroadcasting.join(5)
        assert not rebroadcasting.raised and rebroadcasting.watcher.rebroadcasts == 1


def test_one_renewal_that_timed_out_is_tried_again_soon(
    node: Chain,  # noqa: F811
    stallable: tuple[subprocess.Popen[bytes], Redis],  # noqa: F811
):
    """Default constants (lease 12 s, valid 7 s, renewed every 3 s, each call given up after 1 s). Redis stops for
    1.5 s over the first renewal round: it times out at 4 s; the next try comes 0.5 s later (not at 7 s, where the
    validity ends), so the lease never comes near its end and take() keeps the same account."""
    proc, redis = stallable
    account = node.relay_account()
    began = time.monotonic()
    pool = accounts_module.AccountPool(redis, node.chain, [account], None)
    try:
        owned = pool.take(wait_seconds=1)
        threading.Timer(max(0.0, began + 2.7 - time.monotonic()), _stall, (proc, 1.5)).start()
        slack = float("inf")
        while time.monotonic() < began + 8.5:
            slack = min(slack, owned.valid_until - time.monotonic())
            time.sleep(0.01)
        assert slack > 1.5, slack  # without the soon retry: ~0 s at 7 s
        assert owned.valid() and pool.take(wait_seconds=1) is owned
    finally:
        pool.release()


def test_a_given_back_account_is_not_leased_again_while_its_broadcast_is_under_way(
    node: Chain,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(accounts_module, "RELEASE_WAIT_SECONDS", 0.5)
    account = node.relay_account()
    start = node.w3.eth.get_transaction_count(account.address)
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    try:
        with _Slow(node.network.rpc_url or "", "eth_sendRawTransaction", 2.0) as proxy:
            owned = pool.take(wait_seconds=1)
            sending = _broadcasting(_via(node, proxy.url), owned, _cancel(node, owned))  # nonce `start`, in flight
            assert proxy.arrived.wait(5)
            pool._give_back(owned)  # waits 0.5 s, leaves the key (this pool's token) to lapse
            assert pool.lease(account.address) is None  # its own key, yet the broadcast is still under way
            sending.join(10)
        again = pool.lease(account.address)
        assert again is not None and again is not owned
        assert again.manager.next_nonce == start + 1  # not the nonce that was in flight
    finally:
        pool.release()


def test_a_released_pool_leases_nothing_again(node: Chain, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    monkeypatch.setattr(accounts_module, "RELEASE_WAIT_SECONDS", 0.5)
    account = node.relay_account()
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    with _Slow(node.network.rpc_url or "", "eth_sendRawTransaction", 2.0) as proxy:
        owned = pool.take(wait_seconds=1)
        sending = _broadcasting(_via(node, proxy.url), owned, _cancel(node, owned))
        assert proxy.arrived.wait(5)
        pool.release()  # waits 0.5 s, leaves the key (this pool's token) to lapse
        with pytest.raises(relay.RelayUnavailable):  # a settlement thread outliving the stop
            pool.take(wait_seconds=1)
        assert pool.lease(account.address) is None
        assert pool._retired[account.address] is owned
        sending.join(10)
    node.redis.delete(owned.key)


def test_a_start_whose_renewal_raises_leaves_no_orphan(node: Chain, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    account = node.relay_account()
    pool = accounts_module.AccountPool(node.redis, node.chain, [account], None)
    real = pool._renew_key
    calls = [0]

    def renew_key(key: str) -> bool:  # Redis stalls at the start's last renewal (a remote outage)
        calls[0] += 1
        if calls[0] == 2:
            raise RedisTimeoutError("Timeout reading from socket")
        return real(key)

    monkeypatch.setattr(pool, "_renew_key", renew_key)
    try:
        with pytest.raises(RedisTimeoutError):
            pool.lease(account.address)
        orphan = pool._retired[account.address]  # kept: a new lease here waits for its broadcasts
        assert orphan.given_up and not orphan.valid()
        again = pool.lease(account.address)  # its own key, taken back
        assert again is not None and again is not orphan and again.valid()
    finally:
        pool.release()
