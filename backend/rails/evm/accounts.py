"""The relay accounts one relayer process owns on one EVM chain, each with its local nonce manager.

A process leases an account for its lifetime (a Redis key holding the process's token, renewed every third of
``LEASE_SECONDS`` by a daemon thread), so two relayer processes never send from the same account, and a dead
process's accounts are free again within ``LEASE_SECONDS``. A process holds one account and leases another only
when every one it holds is left aside (short of ETH); with several processes each holds its share; when none is
free it waits (``RelayUnavailable`` after ``wait_seconds``). A lease found taken by another process at renewal is
given up at once (the account is no longer used here).

On first use of an account its ``NonceManager`` starts after every nonce that may have been used (the chain's
pending count, the Redis hint, and the highest ``relay_nonce`` a settlement recorded: ``recorded_nonce``, given by
the caller so the rail needs no database), and the gaps below it are filled with cancel transactions (0 wei to
itself). A settlement whose transaction was at such a gap then finds it UNKNOWN and is sent again at a new nonce:
that nonce is above the gap's, so the new transaction can only be mined once the gap's nonce is consumed (by the
cancel, or by the first transaction if some pool still had it: then the authorization is used, and the second
reverts harmlessly: EIP-3009 executes an authorization once). docs/architecture.md, "Nonces".
"""

from __future__ import annotations

import atexit
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from eth_account.signers.local import LocalAccount
from redis import Redis

from backend.chains.evm import EvmChain
from backend.rails.evm.nonces import NonceManager
from backend.rails.evm.pipeline import shared_watcher
from backend.rails.evm.relay import LEASE_KEY, RelayUnavailable, fees

log = logging.getLogger(__name__)

LEASE_SECONDS = 30  # a dead relayer's accounts are free again within this
RecordedNonce = Callable[[str, str], "int | None"]  # (network, relay address) -> highest relay_nonce recorded


@dataclass
class Owned:
    account: LocalAccount
    manager: NonceManager
    key: str


class AccountPool:
    """The accounts of ``accounts`` this process leased on ``chain``'s network, and their nonce managers."""

    def __init__(
        self,
        redis: Redis,
        chain: EvmChain,
        accounts: list[LocalAccount],
        recorded_nonce: RecordedNonce | None,
        lease_seconds: int = LEASE_SECONDS,
    ) -> None:
        self.redis = redis
        self.chain = chain
        self.network = chain.network.network
        self.accounts = accounts
        self.recorded_nonce = recorded_nonce
        self.lease_seconds = lease_seconds
        self.token = secrets.token_hex(8).encode()
        self._lock = threading.Lock()
        self._owned: dict[str, Owned] = {}
        self._next = 0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def owned(self) -> list[str]:
        with self._lock:
            return list(self._owned)

    def take(self, skip: frozenset[str] = frozenset(), wait_seconds: float = 20) -> Owned:
        """An account of this process not in ``skip`` (round robin), else a newly leased free one, waiting for one."""
        deadline = time.monotonic() + wait_seconds
        candidates = [account for account in self.accounts if account.address not in skip]
        if not candidates:
            raise RelayUnavailable(f"no relay account of {self.network} to use")
        while True:
            with self._lock:
                usable = [owned for address, owned in self._owned.items() if address not in skip]
                if usable:
                    self._next += 1
                    return usable[self._next % len(usable)]
                for account in candidates:
                    key = LEASE_KEY.format(self.network, account.address)
                    if self.redis.set(key, self.token, nx=True, ex=self.lease_seconds):
                        owned = self._start(account, key)
                        self._owned[account.address] = owned
                        self._ensure_renewer()
                        return owned
            if time.monotonic() > deadline:
                raise RelayUnavailable(f"no relay account of {self.network} became free within {wait_seconds:.0f}s")
            time.sleep(0.1)

    def _start(self, account: LocalAccount, key: str) -> Owned:
        """Start the account's nonce manager after every nonce that may be used, and fill the gaps (cancels)."""
        manager = NonceManager.for_chain(self.chain, account.address, self.redis)
        try:
            recorded = self.recorded_nonce(self.network, account.address) if self.recorded_nonce else None
            gaps = manager.start(recorded)
            for nonce in gaps:
                self._cancel(account, manager, nonce)
        except BaseException:
            self.redis.delete(key)  # not started: not ours (the next job leases it again)
            raise
        log.info("relay account %s on %s: owned by this process, next nonce %d", account.address, self.network,
                 manager.next_nonce)  # fmt: skip
        return Owned(account, manager, key)

    def _cancel(self, account: LocalAccount, manager: NonceManager, nonce: int) -> None:
        signed = account.sign_transaction(manager.cancel_transaction(nonce, fees(self.chain)))
        tx_hash = "0x" + bytes(signed.hash).hex()
        shared_watcher(self.chain).expect(tx_hash, bytes(signed.raw_transaction))
        try:
            self.chain.w3.eth.send_raw_transaction(signed.raw_transaction)
        except Exception as exc:
            # "already known", "underpriced", "nonce too low": the node holds or mined a transaction at that nonce.
            log.warning("relay account %s on %s: gap %d not filled (%s)", account.address, self.network, nonce, exc)
            shared_watcher(self.chain).forget(tx_hash)
            return
        manager.sent(nonce, tx_hash)
        log.warning("relay account %s on %s: gap at nonce %d filled with a cancel %s", account.address, self.network,
                    nonce, tx_hash)  # fmt: skip

    def lost(self, address: str) -> None:
        """Stop using ``address`` (its lease is gone or another's)."""
        with self._lock:
            owned = self._owned.pop(address, None)
        if owned is not None:
            log.error("relay account %s on %s: lease lost; no longer used by this process", address, self.network)

    def renew(self) -> None:
        with self._lock:
            held_here = [(address, owned.key) for address, owned in self._owned.items()]
        for address, key in held_here:
            held = self.redis.get(key)
            if held == self.token:
                self.redis.expire(key, self.lease_seconds)
            elif held is not None or not self.redis.set(key, self.token, nx=True, ex=self.lease_seconds):
                self.lost(address)

    def _ensure_renewer(self) -> None:
        if self._renewer is not None and self._renewer.is_alive():
            return

        def run() -> None:
            while not self._stop.wait(self.lease_seconds / 3):
                try:
                    self.renew()
                except Exception as exc:  # Redis away: tried again; the lease lasts lease_seconds
                    log.warning("relay account leases of %s not renewed: %s", self.network, type(exc).__name__)

        self._renewer = threading.Thread(target=run, name=f"relay-leases-{self.network}", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        """Give up every account (a clean stop: another process may take them at once)."""
        self._stop.set()
        with self._lock:
            owned, self._owned = self._owned, {}
        for entry in owned.values():
            try:
                if self.redis.get(entry.key) == self.token:
                    self.redis.delete(entry.key)
            except Exception:
                pass


_pools: dict[str, AccountPool] = {}
_pools_lock = threading.Lock()


def account_pool(
    redis: Redis, chain: EvmChain, accounts: list[LocalAccount], recorded_nonce: RecordedNonce | None
) -> AccountPool:
    """The process's pool of ``chain``'s network (one per network and process)."""
    network = chain.network.network
    with _pools_lock:
        pool = _pools.get(network)
        if (
            pool is None
            or pool.chain is not chain
            or [a.address for a in pool.accounts] != [a.address for a in accounts]
        ):
            if pool is not None:
                pool.release()
            pool = _pools[network] = AccountPool(redis, chain, accounts, recorded_nonce)
        return pool


@atexit.register
def _release_all() -> None:
    with _pools_lock:
        for pool in _pools.values():
            pool.release()
