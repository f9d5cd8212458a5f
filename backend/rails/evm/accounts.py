"""The relay accounts one relayer process owns on one EVM chain, each with its local nonce manager.

A process leases an account for its lifetime (a Redis key holding the process's token, renewed every
``RENEW_SECONDS`` by a daemon thread), so two relayer processes never send from the same account, and a dead
process's accounts are free again within ``LEASE_SECONDS``, or at once for a relayer restarted in the dead one's
identity slot (``identity.py``: the slot's lock proves its earlier holders dead), which takes them back. A process
holds one account and leases another only when every one it holds is left aside (short of ETH); with several
processes each holds its share; when none is free it waits (``RelayUnavailable`` after ``wait_seconds``). A lease
found taken by another process, or gone, at renewal is given up at once (the account is no longer used here; leased
again later, it starts afresh). A second thread repairs the owned accounts and adopts free ones a dead relayer left
with an unmined nonce (``adopt``). Every broadcast from a leased account (the watcher's rebroadcast too:
``Owned.resend``) checks the lease right before it (``fence.broadcast``), is never retried once the lease is not surely
ours, and a release (``release``, at exit) waits for the broadcasts under way before freeing the lease. A key still
holding this pool's own token (its renewals failed while Redis stalled, so the account was given up here) is taken
again at once: nobody else held it meanwhile.

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
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable

from eth_account.signers.local import LocalAccount
from redis import ConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from backend.chains.evm import RPC_CONNECT_TIMEOUT_SECONDS, EvmChain
from backend.rails.evm.fence import LeaseLost, Owned, broadcast, node_answered
from backend.rails.evm.nonces import NonceManager
from backend.rails.evm.pipeline import shared_watcher
from backend.rails.evm.relay import LEASE_KEY, RelayUnavailable, already_known, fees

log = logging.getLogger(__name__)

LEASE_SECONDS = 12  # a dead relayer's accounts are free again within this (at once for its restart: ``identity``)
RENEW_SECONDS = 3.0  # how often the leases are renewed
# A lease is used for a broadcast only until this long before it may lapse in Redis (measured from the start of the
# renewal that set it, on the monotonic clock): room for a pause (GC, a stopped VM) between the check and the send.
LEASE_MARGIN_SECONDS = 5.0
# Each renewal's Redis call gives up after this long (no retry), so a stalled Redis or a connection that went dead
# (a failover, a dropped route) never holds the renewer past the lease: the next round uses a new connection.
RENEW_TIMEOUT_SECONDS = 1.0
# After a renewal that failed (a timeout, a reset) the next is tried this soon, not ``RENEW_SECONDS`` later: one
# failed round must not use up the lease's validity (7 s: renewals start at 3 s, 4.5 s, 6 s after the last good one).
RENEW_RETRY_SECONDS = 0.5
# A release (a clean stop) waits at most this long for the broadcasts under way from an account before deleting its
# key; one still under way then keeps the key, which lapses by itself (``LEASE_SECONDS``). A new lease here of an
# account given up (lapsed, lost) waits as long for its last lease's broadcasts, else is tried again later.
RELEASE_WAIT_SECONDS = 3.0
# A broadcast's connection is made within RPC_CONNECT_TIMEOUT_SECONDS, and sent at once: within the margin.
assert RPC_CONNECT_TIMEOUT_SECONDS < LEASE_MARGIN_SECONDS
REPAIR_SECONDS = 3.0  # how often the nonces the node lacks below an account's next nonce are filled
ADOPT_SECONDS = 15.0  # how often free accounts are looked at for a dead relayer's unmined nonces (``adopt``)
RecordedNonce = Callable[[str, str], "int | None"]  # (network, relay address) -> highest relay_nonce recorded


# Compare-and-set on the lease key: only the process whose token it holds renews or deletes it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('expire', KEYS[1], ARGV[2]) end return 0"
_DELETE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# A free key is set; one holding another process of this identity's value (``ARGV[2]``, never this process's own:
# ``ARGV[3]``) is taken over: that process held this identity's slot, which this one holds now, so it is dead. One
# still holding this pool's own token (``ARGV[1]``: given up here when its renewals failed, yet never lapsed, so no
# other process held it since) is this pool's again, renewed.
_ACQUIRE = """
local held = redis.call('get', KEYS[1])
if not held then redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[4]) return 1 end
if held == ARGV[1] then redis.call('expire', KEYS[1], ARGV[4]) return 3 end
if ARGV[2] ~= '' and string.sub(held, 1, #ARGV[2]) == ARGV[2] and string.sub(held, 1, #ARGV[3]) ~= ARGV[3] then
  redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[4]) return 2
end
return 0
"""
_PROCESS = secrets.token_hex(8)  # this process (its pools' lease values share it)


class AccountPool:
    """The accounts of ``accounts`` this process leased on ``chain``'s network, and their nonce managers."""

    def __init__(
        self,
        redis: Redis,
        chain: EvmChain,
        accounts: list[LocalAccount],
        recorded_nonce: RecordedNonce | None,
        lease_seconds: int = LEASE_SECONDS,
        identity: str | None = None,
    ) -> None:
        self.redis = redis
        self.chain = chain
        self.network = chain.network.network
        self.accounts = accounts
        self.recorded_nonce = recorded_nonce
        self.lease_seconds = lease_seconds
        # The lease value: "<identity>:<process>:<pool>" (``identity``: this process's slot, ``identity.claim``).
        self.identity = identity or ""
        self.token = f"{self.identity}:{_PROCESS}:{secrets.token_hex(8)}".encode()
        self._lock = threading.Lock()
        self._owned: dict[str, Owned] = {}
        self._next = 0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._repairer: threading.Thread | None = None
        self._starting: set[str] = set()  # accounts whose start runs now (outside ``_lock``)
        # The last ``Owned`` given up per account (lapsed or lost): a new lease here starts only once none of its
        # broadcasts is under way (a new start reads the chain's count, which that broadcast may not be in yet).
        self._retired: dict[str, Owned] = {}
        self._renewer_redis = _with_timeout(redis, RENEW_TIMEOUT_SECONDS)  # the renewals' client (socket timeout)

    def owned(self) -> list[str]:
        with self._lock:
            return list(self._owned)

    def take(self, skip: frozenset[str] = frozenset(), wait_seconds: float = 20) -> Owned:
        """An account of this process not in ``skip`` (round robin), else a newly leased free one, waiting for one."""
        deadline = time.monotonic() + wait_seconds
        candidates = [account for account in self.accounts if account.address not in skip]
        if not candidates:
            raise RelayUnavailable(f"no relay account of {self.network} to use")
        if self._stop.is_set():
            raise RelayUnavailable(f"the relay accounts of {self.network} were released (the relayer is stopping)")
        with self._lock:
            self._ensure_threads()  # started first, and again if one died
        while True:
            with self._lock:
                for address in [a for a, owned in self._owned.items() if not owned.valid()]:
                    # Not renewed in time (a paused process, Redis away): another process may own it now.
                    log.error("relay account %s on %s: lease not renewed in time; no longer used by this process",
                              address, self.network)  # fmt: skip
                    retired = self._retired[address] = self._owned.pop(address)
                    retired.given_up = True  # a renewal in flight never makes it valid again
                usable = [o for address, o in self._owned.items() if address not in skip]
                # An adopted account (filling a dead relayer's gaps) only when no other is usable: then it is ours.
                usable = [o for o in usable if not o.adopted] or usable
                for o in usable:
                    o.adopted = False
                if usable:
                    self._next += 1
                    return usable[self._next % len(usable)]
                starting = bool(self._starting - skip)  # one being started: waited for, not a second leased
            if not starting:
                for account in candidates:
                    # Reserved under the lock only while no other start runs: one account leased at a time.
                    if self._reserve(account.address, alone=skip):
                        leased = self._lease(account, reserved=True)
                        if leased is not None:
                            return leased
            if time.monotonic() > deadline:
                raise RelayUnavailable(f"no relay account of {self.network} became free within {wait_seconds:.0f}s")
            time.sleep(0.1)

    def lease(self, address: str, keep: int | None = None) -> Owned | None:
        """``address`` owned by this process: already, or leased now if free (its start fills its gaps); None when
        another process holds it or it is not one of ``accounts``. ``keep``: a nonce the caller sends at itself (a
        settlement's recorded one): a start leaves it unfilled, so the transfer goes there rather than over a cancel
        (which, mined first, would take the nonce and leave the payment to the reconciler)."""
        account = next((a for a in self.accounts if a.address == address), None)
        if account is None:
            return None
        with self._lock:
            self._ensure_threads()
            owned = self._owned.get(address)
            if owned is not None:
                return owned if owned.valid() else None
        return self._lease(account, keep=keep)

    def _reserve(self, address: str, alone: frozenset[str] | None = None) -> bool:
        """``address`` marked as starting here, unless owned or starting already (or, with ``alone``, while another
        account not in ``alone`` is starting)."""
        with self._lock:
            if address in self._owned or address in self._starting or (alone is not None and self._starting - alone):
                return False
            self._starting.add(address)
            return True

    def _lease(
        self, account: LocalAccount, adopted: bool = False, reserved: bool = False, keep: int | None = None
    ) -> Owned | None:
        """``account`` leased now if free, and started; None when another process (or another start here) has it.
        The start (RPCs, a database read, cancels) runs outside ``_lock``, so the settlement threads and the renewer
        never wait for it; its broadcasts are checked against the lease, renewed at each of its rounds."""
        address = account.address
        if not reserved and not self._reserve(address):
            return None
        try:
            if self._stop.is_set():
                return None  # released (a clean stop): a settlement thread outliving it leases nothing again
            with self._lock:
                retired = self._retired.pop(address, None)
            if retired is not None and not retired.close(time.monotonic() + RELEASE_WAIT_SECONDS):
                with self._lock:
                    self._retired.setdefault(address, retired)
                return None  # a broadcast from its last lease here still under way: not started again yet
            key = LEASE_KEY.format(self.network, address)
            began = time.monotonic()
            if not self._acquire(key):
                return None
            owned = Owned(account, NonceManager.for_chain(self.chain, address, self.redis), key, adopted=adopted)
            owned.valid_until = began + self._valid_for()
            try:
                self._start(owned, keep)
                started = self._renew(owned)
            except BaseException:
                self._retire(owned)  # its fills (and their watcher entries) never sent from it again
                raise
            if not started:  # the start outlived the lease: not ours any more
                self._retire(owned)
                log.error("relay account %s on %s: lease lost during its start", address, self.network)
                return None
            with self._lock:
                self._owned[address] = owned
            return owned
        finally:
            with self._lock:
                self._starting.discard(address)

    def _retire(self, owned: Owned) -> None:
        """``owned`` given up, and kept as its account's last lease here: a new lease of the account (which may take
        its own key back at once: ``_ACQUIRE``) starts only once none of its broadcasts is under way."""
        with owned.sends:
            owned.given_up = True
        with self._lock:
            self._retired[owned.account.address] = owned

    def _start(self, owned: Owned, keep: int | None = None) -> None:
        """Start the account's nonce manager after every nonce that may be used, and fill the gaps (cancels), up to
        ``keep`` (the caller's to send: left untracked, so its ``take_for_fill`` allocates it)."""
        account, manager = owned.account, owned.manager
        try:
            recorded = self.recorded_nonce(self.network, account.address) if self.recorded_nonce else None
            gaps = manager.start(recorded)
            for nonce in gaps:
                if nonce != keep:
                    manager.unfilled(nonce)  # tracked (never handed out), filled below from the lowest
            # Lowest first, reading the node's pending count again after each fill: a gap the node already holds a
            # transaction for (queued behind a missing nonce: ours, sent before a crash) is counted once the nonce
            # below it is filled, and is never replaced by a cancel (which, with fees risen, would evict it).
            self._fill_from_pending(owned, rounds=len(gaps) + 1, renewing=True, keep=keep)
        except BaseException:
            if owned.close(time.monotonic() + RELEASE_WAIT_SECONDS):  # a rebroadcast under way: the key lapses
                self._delete_key(owned.key)  # not started: not ours (the next job leases it again)
            raise
        log.info("relay account %s on %s: owned by this process, next nonce %d", account.address, self.network,
                 manager.next_nonce)  # fmt: skip

    def repair(self) -> None:
        """For each account owned: while the node's pending count is below the manager's next nonce, the nonce
        it lacks is filled (our own signed bytes sent again if we still have them, else a cancel), so an account
        never stalls behind a refused, lost or unfilled nonce until a restart. Run every ``REPAIR_SECONDS``."""
        with self._lock:
            owned = list(self._owned.values())
        for entry in owned:
            if not entry.valid():
                continue  # its lease may be another's now: nothing is sent from it
            try:
                mined = entry.manager.prune_mined()
                self._repair_account(entry)
                if entry.adopted and mined >= entry.manager.next_nonce:
                    self._give_back(entry)  # every nonce it had is mined: free for any process again
            except Exception as exc:  # an RPC hiccup: the next round tries again
                log.warning("relay account %s on %s: repair failed: %s", entry.account.address, self.network, exc)

    def _repair_account(self, owned: Owned) -> None:
        self._fill_from_pending(owned)

    def _fill_from_pending(
        self, owned: Owned, rounds: int = 16, renewing: bool = False, keep: int | None = None
    ) -> None:
        """While the node's pending count is below the manager's next nonce, the nonce it lacks (that count) is
        filled: our own bytes again, else a cancel; the count is read again after each fill. Each broadcast is
        checked against the lease; ``renewing`` (a start) renews it at each round, and stops once it is lost."""
        account, manager = owned.account, owned.manager
        watcher = shared_watcher(self.chain)
        last = -1
        for _ in range(rounds):
            if renewing and not self._renew(owned):
                return  # lost during the start: the caller finds it so
            if not owned.valid():
                return  # nothing is sent from an account that may be another's
            pending = manager.chain_count("pending")
            if pending == last:
                return  # the fill did not move the count (the node queues it or is behind): the next round looks
            if pending == keep:
                return  # the caller's: its transfer goes there (later gaps wait for it; the repair step fills them)
            last = pending
            taken = manager.take_for_fill(pending)
            if taken is None:
                return
            kind, tx_hash = taken
            if kind == "resend" and tx_hash is not None:
                raw = watcher.raw_of(tx_hash)
                if raw is not None:
                    try:
                        broadcast(self.chain, owned, raw)
                        log.warning("relay account %s on %s: nonce %d lacked by the node: %s sent again",
                                    account.address, self.network, pending, tx_hash)  # fmt: skip
                        continue
                    except LeaseLost:
                        manager.reclaim(pending)
                        manager.unfilled(pending)  # its next owner's start (or a renewed lease's repair) fills it
                        return
                    except Exception as exc:
                        if already_known(exc):
                            continue
                        if not node_answered(exc):
                            return
                manager.reclaim(pending)  # no bytes, or refused: a cancel takes the nonce
            fill_nonce(self.chain, owned, pending)

    def lost(self, address: str) -> None:
        """Stop using ``address`` (its lease is gone or another's): no send of this process broadcasts from it any
        more (``valid`` is False from now on, checked right before each broadcast)."""
        with self._lock:
            owned = self._owned.pop(address, None)
            if owned is not None:
                self._retired[address] = owned
        if owned is not None:
            owned.given_up = True
            owned.valid_until = 0.0
            log.error("relay account %s on %s: lease lost; no longer used by this process", address, self.network)

    def _give_back(self, owned: Owned) -> None:
        with self._lock:
            if self._owned.get(owned.account.address) is owned:
                del self._owned[owned.account.address]
        if owned.close(time.monotonic() + RELEASE_WAIT_SECONDS):
            self._delete_key(owned.key)
        else:
            self._retire(owned)  # its key (this pool's token) lapses; a new lease here waits for the broadcast
        log.info("relay account %s on %s: adopted account released (all its nonces mined)", owned.account.address,
                 self.network)  # fmt: skip

    def _acquire(self, key: str) -> bool:
        """The lease of ``key`` set to this pool's token if free, or taken over from a dead process of this identity."""
        mine = f"{self.identity}:" if self.identity else ""
        this_process = f"{self.identity}:{_PROCESS}:"
        got = int(self.redis.eval(_ACQUIRE, 1, key, self.token, mine, this_process, self.lease_seconds))
        if got == 2:
            log.warning("relay account lease %s taken back from a dead relayer of this identity slot", key)
        elif got == 3:
            log.warning("relay account lease %s still held by this process (renewals failed): taken again", key)
        return got > 0

    def _valid_for(self) -> float:
        return self.lease_seconds - min(LEASE_MARGIN_SECONDS, self.lease_seconds / 2)

    def _renew_key(self, key: str) -> bool:
        return bool(self._renewer_redis.eval(_RENEW, 1, key, self.token, self.lease_seconds))

    def _renew(self, owned: Owned) -> bool:
        """``owned``'s lease renewed (compare-and-set): True and valid for longer, else False (never valid again)."""
        began = time.monotonic()
        if owned.given_up or not self._renew_key(owned.key):
            return False
        if not owned.given_up:  # given up meanwhile (``lost``, ``release``): stays given up
            owned.valid_until = began + self._valid_for()
        return not owned.given_up

    def _delete_key(self, key: str) -> None:
        self.redis.eval(_DELETE, 1, key, self.token)

    def renew(self) -> bool:
        """Each owned account's lease renewed (compare-and-set on this process's token); one whose key holds
        another's token or is gone is given up. A gone key is never set again here: while it was gone another
        process may have leased the account, sent from it and died (recording nonces this process's manager never
        saw), so only a new lease (``take``/``lease``, whose start reads the chain and the records again) may use
        the account again. Errors are caught per account; a timeout ends the round (each later call would wait as
        long). False when one failed: the renewer tries again after ``RENEW_RETRY_SECONDS``."""
        with self._lock:
            held_here = [(address, owned) for address, owned in self._owned.items()]
        renewed = True
        for address, owned in held_here:
            try:
                if not self._renew(owned) and not owned.given_up:
                    self.lost(address)
            except Exception as exc:  # Redis away, a reset: tried again soon (the lease lasts)
                log.warning("relay account lease of %s on %s not renewed: %s", address, self.network,
                            type(exc).__name__)  # fmt: skip
                if isinstance(exc, RedisTimeoutError):
                    return False
                renewed = False
        return renewed

    def _ensure_threads(self) -> None:
        """The renewer (renewals only: Redis round trips, never an RPC nor the database, so a slow node or a slow
        repair never lets a lease lapse) and the repairer (repair, then adoption), each started again if it died."""
        if self._renewer is None or not self._renewer.is_alive():

            def renewing() -> None:
                interval = min(RENEW_SECONDS, self.lease_seconds / 4)
                wait = interval
                while not self._stop.wait(wait):
                    try:
                        wait = interval if self.renew() else min(RENEW_RETRY_SECONDS, interval)
                    except Exception as exc:  # tried again soon; the lease lasts lease_seconds
                        log.warning("relay account leases of %s not renewed: %s", self.network, type(exc).__name__)
                        wait = min(RENEW_RETRY_SECONDS, interval)

            self._renewer = threading.Thread(target=renewing, name=f"relay-leases-{self.network}", daemon=True)
            self._renewer.start()
        if self._repairer is None or not self._repairer.is_alive():

            def repairing() -> None:
                adopted = time.monotonic()
                while not self._stop.wait(REPAIR_SECONDS):
                    self.repair()
                    if time.monotonic() - adopted < ADOPT_SECONDS:
                        continue
                    adopted = time.monotonic()
                    try:
                        self.adopt()
                    except Exception as exc:  # an RPC or database hiccup: the next round tries again
                        log.warning("relay accounts of %s: adoption failed: %s", self.network, exc)

            self._repairer = threading.Thread(target=repairing, name=f"relay-repair-{self.network}", daemon=True)
            self._repairer.start()

    def adopt(self) -> list[str]:
        """Every free account (no live lease) with an open nonce, one recorded by a settlement and not mined yet (a
        dead or stopped relayer's, maybe with a gap below it), leased and started here: its start fills the gaps
        lowest first, so the transactions the node holds queued behind them are mined. Used for new sends only when
        no other account is usable (a retry of its own settlements may re-sign at their nonces: ``lease``);
        released once the chain mined every nonce below its next one. Run every ``ADOPT_SECONDS`` by the repair
        thread."""
        adopted: list[str] = []
        for account in self.accounts:
            address = account.address
            with self._lock:
                if address in self._owned or address in self._starting:
                    continue
            if self.redis.exists(LEASE_KEY.format(self.network, address)):
                continue  # a live owner: its repair fills its gaps
            if self.recorded_nonce is None:
                return adopted
            # A settlement's recorded nonce, never the Redis hint alone: the hint may be stale or another
            # deployment's (a devnet reset, a shared Redis), and an unrecorded transaction has no settlement waiting.
            highest = self.recorded_nonce(self.network, address)
            if highest is None or highest < NonceManager.for_chain(self.chain, address, self.redis).chain_count(
                "latest"
            ):
                continue  # nothing open on it
            if self._lease(account, adopted=True) is not None:
                log.warning("relay account %s on %s: adopted (nonce %d not mined, no live lease)", address,
                            self.network, highest)  # fmt: skip
                adopted.append(address)
        return adopted

    def release(self) -> None:
        """Give up every account (a clean stop: another process may take them at once). No broadcast starts from
        them any more; each key is deleted once the broadcasts under way from its account are done (waited for up
        to ``RELEASE_WAIT_SECONDS`` in all), else left to lapse."""
        self._stop.set()
        with self._lock:
            owned, self._owned = self._owned, {}
        for entry in owned.values():
            entry.given_up = True  # no broadcast from any of them starts from now on
        deadline = time.monotonic() + RELEASE_WAIT_SECONDS
        for entry in owned.values():
            if not entry.close(deadline):
                self._retire(entry)
                log.warning("relay account %s on %s: a broadcast still under way at the release; its lease is left "
                            "to lapse", entry.account.address, self.network)  # fmt: skip
                continue
            with contextlib.suppress(Exception):
                self._delete_key(entry.key)
        self._renewer_redis.connection_pool.disconnect()


def _with_timeout(redis: Redis, seconds: float) -> Redis:
    """A client of ``redis``'s server whose calls fail after ``seconds`` (connecting, or waiting for an answer), and
    are never retried."""
    pool = redis.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": seconds, "socket_connect_timeout": seconds}
    kwargs["retry"] = Retry(NoBackoff(), 0)
    kwargs.pop("retry_on_timeout", None)
    return Redis(connection_pool=ConnectionPool(connection_class=pool.connection_class, **kwargs))


def fill_nonce(chain: EvmChain, owned: Owned, nonce: int) -> str | None:
    """A cancel (0 wei to itself) at ``nonce``, allocated by the caller: ``sent`` once the node took it (its hash),
    else ``unfilled`` (the repair step tries again, or the account's next owner; None). Never broadcast once the
    lease is not surely ours."""
    account, manager = owned.account, owned.manager
    watcher = shared_watcher(chain)
    tx_hash = None
    try:
        signed = account.sign_transaction(manager.cancel_transaction(nonce, fees(chain)))
        tx_hash = "0x" + bytes(signed.hash).hex()
        watcher.expect(tx_hash, bytes(signed.raw_transaction), owned)
        broadcast(chain, owned, bytes(signed.raw_transaction))
    except LeaseLost:
        log.warning("relay account %s on %s: nonce %d not filled (lease not surely ours)", account.address,
                    chain.network.network, nonce)  # fmt: skip
        if tx_hash is not None:
            watcher.forget(tx_hash)
        manager.unfilled(nonce)
        return None
    except Exception as exc:
        message = str(exc).lower()
        if tx_hash is None or not already_known(exc):
            # "underpriced", "nonce too low": the node holds or mined a transaction at that nonce; or refused.
            log.warning("relay account %s on %s: nonce %d not filled (%s)", account.address, chain.network.network,
                        nonce, exc)  # fmt: skip
            if tx_hash is not None:
                watcher.forget(tx_hash)
            if "nonce too low" in message:
                manager.consumed(nonce)
            else:
                manager.unfilled(nonce)
            return None
    manager.sent(nonce, tx_hash, fill=True)
    log.warning("relay account %s on %s: nonce %d filled with a cancel %s", account.address, chain.network.network,
                nonce, tx_hash)  # fmt: skip
    return tx_hash


_pools: dict[str, AccountPool] = {}
_pools_lock = threading.Lock()
_identity: list[str | None] = [None]


def use_identity(identity: str | None) -> None:
    """The pools made from now on lease in ``identity`` (``identity.claim``: the relayer main, once at start)."""
    _identity[0] = identity


def account_pool(
    redis: Redis, chain: EvmChain, accounts: list[LocalAccount], recorded_nonce: RecordedNonce | None
) -> AccountPool:
    """The process's pool of ``chain``'s network (one per network and process), leasing in this process's identity
    (``use_identity``)."""
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
            pool = _pools[network] = AccountPool(redis, chain, accounts, recorded_nonce, identity=_identity[0])
        return pool


@atexit.register
def release_all() -> None:
    """Every pool's accounts given up (a clean stop: the relayer main's end, and at exit)."""
    with _pools_lock:
        for pool in _pools.values():
            pool.release()
        _pools.clear()  # a later send makes a new pool (a released one never leases again)
