"""A local nonce manager for one relay account on one EVM chain: many transactions in flight, no gap, no reuse.

The pipelined relayer (docs/architecture.md, "Nonces") holds one ``NonceManager`` per (chain, relay account) it
owns. ``start`` picks the first nonce after every one that may have been used: the chain's "pending" count (what
the node holds), the Redis hint of the last transaction sent (``NONCE_KEY``: "nonce:hash", shared with
``relay.send``) and the highest nonce a settlement recorded (``settlements.relay_nonce``, written before the
broadcast); the nonces the chain has not counted below that are the *gaps* (a crash between the record and the
broadcast, or a node that dropped them), which the caller fills: a settlement's own transaction sent again (or
its replacement) at its recorded nonce, else ``cancel_transaction``. A nonce handed out and never broadcast goes
back (``returned``) and is the next one handed out, so it leaves no gap.

The rule (one transaction per settlement may ever be mined): a settlement's second transaction only ever goes at
its first's (account, nonce), as the same transaction sent again or a replacement with higher fees
(``replacement_fees``). Never at a new nonce while the first may still be mined: at one nonce the chain mines at
most one transaction, so at most one of them can execute the authorization, whatever the pool did with the other.

Today's ``relay.send`` does not follow the rule: on "nonce too low" or "underpriced" it signs again at a new
nonce, the reconciler's resend too, and a send error that is not final (a timeout) leaves the row's nonce with
no Redis hint, so the next settlement may record the same (account, nonce) on a second row. For money that is
harmless (the token executes an authorization once, whichever transaction carries it; the other costs gas), but
a replacement "at the settlement's recorded nonce" could then replace another settlement's transaction. So the
pipeline owns every nonce (``returned`` only before the nonce is recorded), and (network, relay_address,
relay_nonce) is unique over open settlements (migration 0012): a second record of an open one's nonce fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from eth_utils import to_checksum_address
from redis import Redis
from web3 import Web3

from backend.chains.evm import EvmChain
from backend.rails.evm.relay import NONCE_KEY

log = logging.getLogger(__name__)

CANCEL_GAS = 21_000  # a plain transfer of 0 wei: the cheapest transaction that takes a nonce
# Each fee of a replacement is at least this much above the one it replaces (geth refuses less than 10 % as
# "replacement transaction underpriced", Anvil any fee not above the old one; 12.5 % leaves room for nodes that
# round or ask a little more).
BUMP_NUMERATOR, BUMP_DENOMINATOR = 9, 8


def bumped(fee: int) -> int:
    """``fee`` raised by 12.5 %, rounded up, and by at least 1 wei (a tip of 0 becomes 1: a node refuses a
    replacement whose fees are not above the old ones)."""
    return max(-(-fee * BUMP_NUMERATOR // BUMP_DENOMINATOR), fee + 1)


def replacement_fees(
    old: dict[str, int], current: dict[str, int], cap_wei_per_gas: int | None
) -> dict[str, int] | None:
    """The EIP-1559 fees of a transaction that replaces one sent with ``old`` at the same nonce.

    Both maxFeePerGas and maxPriorityFeePerGas are at least 12.5 % above ``old``'s (rounded up) and at least
    ``current``'s (the market's now, ``relay.fees``); the tip is never above the fee cap. ``cap_wei_per_gas``
    bounds maxFeePerGas (so the relay's worst cost, ``GAS_LIMIT`` * maxFeePerGas, stays within ``GAS_LIMIT`` *
    the cap); the market's fees give way to it, the bump does not: None when the cap leaves no valid bump (the
    transaction is left as it is, or cancelled by the caller's choice)."""
    old_cap, old_tip = int(old["maxFeePerGas"]), int(old["maxPriorityFeePerGas"])
    least_cap, least_tip = bumped(old_cap), bumped(old_tip)
    tip = max(least_tip, int(current.get("maxPriorityFeePerGas") or 0))
    fee_cap = max(least_cap, int(current.get("maxFeePerGas") or 0), tip)
    if cap_wei_per_gas is not None:
        fee_cap = min(fee_cap, cap_wei_per_gas)
        tip = min(tip, fee_cap)
        if fee_cap < least_cap or tip < least_tip:
            return None
    return {"maxFeePerGas": fee_cap, "maxPriorityFeePerGas": tip}


@dataclass(frozen=True)
class InFlight:
    """A transaction sent from the account that the chain's latest block had not counted when last looked at."""

    nonce: int
    tx_hash: str
    sent_at: float  # the manager's clock (monotonic seconds) when it was last sent


class NonceManager:
    """The nonces of one relay account on one chain, for one owner at a time (the relayer that holds the account's
    lease); thread-safe, so many sends of that owner share it.

    ``start`` first; then ``allocate`` per transaction, and after it either ``sent`` (broadcast, or at least
    handed to the node) or ``returned`` (never broadcast: a pre-send check failed). ``resync`` after the node's
    "nonce too low"; ``stuck`` lists what has waited too long (to send again or replace at the same nonce)."""

    def __init__(
        self,
        w3: Web3,
        network: str,
        address: str,
        chain_id: int,
        redis: Redis,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.w3 = w3
        self.network = network
        self.address = to_checksum_address(address)
        self.chain_id = chain_id
        self.redis = redis
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._next: int | None = None  # the next fresh nonce (None until ``start``)
        self._free: set[int] = set()  # returned, below ``_next``: handed out again first (lowest first)
        self._allocated: set[int] = set()  # handed out, neither sent nor returned yet
        self._in_flight: dict[int, InFlight] = {}
        # Recorded on a settlement, not taken by the node, and no fill (cancel) sent yet: ``repair``'s to fill.
        self._unfilled: set[int] = set()
        self._fills: set[str] = set()  # the hashes of the cancels sent to fill nonces (a retry may replace one)
        # The chain's pending count at ``start``, raised by ``resync`` (never lowered: a lagging node answers
        # less): nonces below it are counted, so never handed out again nor taken back by ``returned``.
        self._floor = 0
        self._hint_lock = threading.Lock()  # orders the Redis hint writes without holding ``_lock``
        self._hinted = -1  # the highest nonce written to the Redis hint by this manager

    @classmethod
    def for_chain(cls, chain: EvmChain, address: str, redis: Redis, **kwargs: Any) -> NonceManager:
        chain_id = chain.network.chain_id
        if chain_id is None:
            raise ValueError(f"{chain.network.network} has no chain id")
        return cls(chain.w3, chain.network.network, address, chain_id, redis, **kwargs)

    @property
    def hint_key(self) -> str:
        return NONCE_KEY.format(self.network, self.address)

    # The chain and the hint
    def chain_count(self, block: Literal["pending", "latest"] = "pending") -> int:
        """The account's transaction count at ``block`` ("pending": with what the node holds in its pool)."""
        return int(self.w3.eth.get_transaction_count(self.address, block))

    def hint(self) -> tuple[int, str] | None:
        """The Redis hint: the nonce and hash of the last transaction sent from the account (None: none, unreadable)."""
        raw = self.redis.get(self.hint_key)
        if not raw:
            return None
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        nonce, _, tx_hash = text.partition(":")
        try:
            return int(nonce), tx_hash
        except ValueError:
            log.warning("ignoring a malformed nonce hint for %s on %s", self.address, self.network)
            return None

    # The manager's life
    def start(self, recorded_max: int | None) -> list[int]:
        """Take up the account: the next nonce is the highest of the chain's pending count, the Redis hint + 1 and
        ``recorded_max`` + 1 (the highest ``relay_nonce`` of the account's settlements, None: none). Returns the
        gaps: the nonces below it the chain has not counted (each is still queued in the node behind a missing
        one, or lost): the caller sends each settlement's own transaction again at its recorded nonce, and fills
        the rest with ``cancel_transaction``. Forgets what an earlier ``start`` knew (nothing in flight, nothing
        allocated): call it before any ``allocate``, never while senders hold nonces."""
        pending = self.chain_count()
        hint = self.hint()
        candidates = [pending]
        if hint is not None:
            candidates.append(hint[0] + 1)
        if recorded_max is not None:
            candidates.append(recorded_max + 1)
        with self._lock:
            self._next = max(candidates)
            self._floor = pending
            self._free.clear()
            self._allocated.clear()
            self._in_flight.clear()
            self._unfilled.clear()
            gaps = self._gaps()
        with self._hint_lock:
            self._hinted = hint[0] if hint is not None else -1
        if gaps:
            log.warning("relay account %s on %s: nonces %s are not counted by the chain (gaps to fill)",
                        self.address, self.network, gaps)  # fmt: skip
        return gaps

    def resync(self) -> list[int]:
        """After the node's "nonce too low" (someone else used the account, or a lagging node): read the chain
        again. The floor and the next nonce rise to its pending count, never fall (a lagging node answers less);
        returned nonces below the floor are dropped. Returns the gaps as ``start`` does: nonces from the floor
        up the chain has not counted, not in a sender's hands, not returned and not in flight (one of ours the
        node lost is ``stuck``'s, to send again at its nonce, never to cancel)."""
        pending = self.chain_count()
        with self._lock:
            next_nonce = self._require_started()
            self._floor = max(self._floor, pending)
            self._next = max(next_nonce, self._floor)
            self._free = {nonce for nonce in self._free if nonce >= self._floor}
            return self._gaps()

    def _gaps(self) -> list[int]:
        assert self._next is not None
        taken = self._allocated | self._free | self._unfilled | self._in_flight.keys()
        return [n for n in range(self._floor, self._next) if n not in taken]

    def _require_started(self) -> int:
        if self._next is None:
            raise RuntimeError(f"the nonce manager of {self.address} on {self.network} was not started")
        return self._next

    @property
    def next_nonce(self) -> int:
        """The next fresh nonce (a returned one is handed out before it)."""
        with self._lock:
            return self._require_started()

    # Per transaction
    def allocate(self) -> int:
        """A nonce for one transaction: the lowest returned one, else the next fresh one."""
        with self._lock:
            next_nonce = self._require_started()
            if self._free:
                nonce = min(self._free)
                self._free.discard(nonce)
            else:
                nonce = next_nonce
                self._next = next_nonce + 1
            self._allocated.add(nonce)
            return nonce

    def returned(self, nonce: int) -> None:
        """``nonce`` was allocated but never broadcast: it is the next one handed out (the highest ones returned
        just lower the next fresh nonce), so no gap is left once the account sends again. One below the floor
        (the chain counted it since: someone else used it) is dropped. Only before the nonce is recorded on a
        settlement (``relay_nonce``): a recorded one stays that settlement's."""
        with self._lock:
            if nonce not in self._allocated:
                raise ValueError(f"nonce {nonce} of {self.address} was not allocated, or was sent already")
            self._allocated.discard(nonce)
            if nonce < self._floor:
                return
            self._free.add(nonce)
            assert self._next is not None
            while self._next - 1 in self._free:
                self._next -= 1
                self._free.discard(self._next)

    def is_fill(self, tx_hash: str | None) -> bool:
        """Whether ``tx_hash`` is a cancel this manager sent to fill a nonce (``sent(..., fill=True)``)."""
        with self._lock:
            return tx_hash is not None and tx_hash.lower() in self._fills

    def sent(self, nonce: int, tx_hash: str, *, fill: bool = False) -> None:
        """A transaction at ``nonce`` was broadcast (a first one, one sent again, a replacement or a gap's
        cancel, allocated here or not): it is in flight until mined, never handed out again (taken from the
        returned ones; the next fresh nonce moves past it), and the Redis hint names it if it is the highest
        sent (written after the manager's lock is released: no allocation waits for Redis)."""
        with self._lock:
            next_nonce = self._require_started()
            self._allocated.discard(nonce)
            self._free.discard(nonce)
            self._unfilled.discard(nonce)
            self._next = max(next_nonce, nonce + 1)
            self._in_flight[nonce] = InFlight(nonce, tx_hash, self.monotonic())
            if fill:
                self._fills.add(tx_hash.lower())
        with self._hint_lock:
            if nonce >= self._hinted:
                self._hinted = nonce
                self.redis.set(self.hint_key, f"{nonce}:{tx_hash}")

    def unfilled(self, nonce: int) -> None:
        """``nonce`` (allocated, maybe recorded on a settlement) was not taken by the node and its fill failed:
        never handed out again; ``take_for_fill`` gives it to the repair step."""
        with self._lock:
            self._allocated.discard(nonce)
            self._free.discard(nonce)
            if nonce >= self._floor:
                self._unfilled.add(nonce)

    def consumed(self, nonce: int) -> None:
        """The node said ``nonce`` is taken on chain ("nonce too low"): forgotten here."""
        with self._lock:
            self._allocated.discard(nonce)
            self._unfilled.discard(nonce)

    def take_for_fill(self, nonce: int) -> tuple[str, str | None] | None:
        """For the repair step, ``nonce`` being the node's pending count (the lowest one it lacks): ("resend",
        hash) when it is ours in flight (send the same bytes again; ``reclaim`` if they are gone or refused), ("fill",
        None) when it is a hole, an unfilled one or untracked below the next nonce (it is now allocated: a cancel,
        then ``sent``, else ``unfilled``), None when a sender holds it now or it is not below the next nonce."""
        with self._lock:
            next_nonce = self._require_started()
            if nonce >= next_nonce or nonce in self._allocated:
                return None
            if nonce in self._in_flight:
                return "resend", self._in_flight[nonce].tx_hash
            self._free.discard(nonce)
            self._unfilled.discard(nonce)
            self._allocated.add(nonce)
            return "fill", None

    def reclaim(self, nonce: int) -> None:
        """Our in-flight transaction at ``nonce`` cannot be sent again (no bytes, or refused): it is allocated to
        the repair step, which fills it with a cancel."""
        with self._lock:
            self._in_flight.pop(nonce, None)
            self._allocated.add(nonce)

    def holes(self) -> list[int]:
        """Returned nonces not handed out again yet, lowest first: while any is below a sent one, the later
        transactions wait; an idle caller fills them (``allocate`` then ``cancel_transaction``)."""
        with self._lock:
            return sorted(self._free)

    def in_flight(self) -> list[InFlight]:
        """What was sent and not yet seen mined (as of the last ``stuck``), lowest nonce first."""
        with self._lock:
            return [self._in_flight[n] for n in sorted(self._in_flight)]

    def prune_mined(self) -> int:
        """Forget what the chain's latest block counted (in flight below it, and the hashes of those cancels), so
        a process-lifetime manager holds only what is in flight; returns that count. Run by the repair step."""
        mined = self.chain_count("latest")
        with self._lock:
            for nonce in [n for n in self._in_flight if n < mined]:
                del self._in_flight[nonce]
            self._fills &= {tx.tx_hash.lower() for tx in self._in_flight.values()}
        return mined

    def stuck(self, older_than: float) -> list[InFlight]:
        """The transactions sent at least ``older_than`` seconds ago that the chain's latest block has not counted
        yet (mined ones are forgotten here), lowest nonce first: each is sent again, or replaced at the same nonce
        with ``replacement_fees``, by the caller (then ``sent`` again)."""
        mined = self.chain_count("latest")
        now = self.monotonic()
        with self._lock:
            for nonce in [n for n in self._in_flight if n < mined]:
                del self._in_flight[nonce]
            late = [tx for tx in self._in_flight.values() if now - tx.sent_at >= older_than]
        return sorted(late, key=lambda tx: tx.nonce)

    def cancel_transaction(self, nonce: int, fees: dict[str, int]) -> dict[str, Any]:
        """A transaction that takes ``nonce`` and does nothing: 0 wei to the account itself, ``CANCEL_GAS`` gas,
        ``fees`` (EIP-1559 fields). It fills a gap no settlement owns (a settlement's own nonce gets its own
        transaction again, or that transaction's replacement: the module's rule). Raises ValueError when the tip
        is above the fee cap (the node would refuse it)."""
        fee_cap, tip = int(fees["maxFeePerGas"]), int(fees["maxPriorityFeePerGas"])
        if tip > fee_cap:
            raise ValueError(f"a cancel's tip ({tip}) is above its fee cap ({fee_cap})")
        return {
            "type": 2,
            "from": self.address,
            "to": self.address,
            "value": 0,
            "nonce": nonce,
            "gas": CANCEL_GAS,
            "chainId": self.chain_id,
            "maxFeePerGas": fee_cap,
            "maxPriorityFeePerGas": tip,
        }
