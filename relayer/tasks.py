"""The relayer's job: submit one settlement's authorization and finish it from the chain.

One flow for every chain kind: the settlement's rail (``backend.rails``) builds, signs and sends the transaction
(``Rail.submit``), watches it (``watch``, ``wait_landed``, ``wait_final``) and reads what the chain says about the
terms (``settlement.reconcile.settle_from_chain``); what is written to the database is decided here.

Rules that keep it exactly once:
- one job at a time per settlement (a Redis lock held for the whole job);
- the chain is asked first (a retry may find the authorization already executed);
- nothing is sent for an intent that another settlement has already paid; such a settlement is released
  (and watched, on EVM) unless a transaction of ours for it may still land unwatched (Solana: its co-signed
  transaction, until its blockhash expires): then it stays open until the chain decides (``_may_land_unwatched``);
- a revert releases the intent only when none of our transactions for it can still be mined, our
  reverted transaction's block is final, and the authorization is not used on chain (final or not);
  the reconciler keeps watching such a settlement until the chain can no longer execute it;
- a nonce used by another authorization of the buyer (other terms) is not a payment: released;
- paid only once final: with confirmations > 1 the chain is asked again after the wait (a reorg).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backend import appstate, logs
from backend.chains.registry import Network
from backend.errors import DomainError, database_unavailable
from backend.extensions import db
from backend.intents.models import PAID, Intent
from backend.queueing import RedisNotConfigured, app_job, app_redis
from backend.rails.base import (
    CannotSucceed,
    ChainDecides,
    Claim,
    LeftOpen,
    Outcome,
    Rail,
    RelayKeys,
    RelayRefuses,
    Submission,
    TxState,
    TxStatus,
)
from backend.rails.registry import rail_for
from backend.relaybudget import services as relaybudget
from backend.settlement import models as st
from backend.settlement import services
from backend.settlement.flow import notify_settled
from backend.settlement.models import settlement_claim
from backend.settlement.reconcile import FINISHED, ledger_for, paid, rpc_unreachable, settle_from_chain
from relayer.faults import crash_point

log = logging.getLogger(__name__)

RECEIPT_TIMEOUT_SECONDS = 120
# The per-settlement lock lives this long unless its holder renews it (every third of it), so a
# relayer that dies frees its settlements within seconds.
JOB_LOCK_SECONDS = 15
JOB_LOCK_KEY = "payintent:relayer:settling:{}"
# A settlement that meets passing trouble (``_transient``: the database refusing a connection or dropping one, the
# pool's wait running out, a chain's RPC or Redis unreachable) is settled again by its thread, still holding its
# lock, after 0.5 s, then 1, 2, 4, 4... s, until SETTLE_RETRY_SECONDS have passed since the first try. Safe: a
# settlement that was sent asks the chain first (``_settle``). Past it the job fails; the reconciler sends it again.
SETTLE_RETRY_SECONDS = 45.0
SETTLE_RETRY_FIRST_DELAY = 0.5
SETTLE_RETRY_LONGEST_DELAY = 4.0
# Set by relayer.worker at start-up: the only place relay keys live (per network, loaded by its rail).
RELAY_KEYS: dict[str, RelayKeys] = {}


def _redis() -> Redis:
    """The relayer's Redis connection (one per process: ``app_redis`` keeps it on the app)."""
    redis = app_redis()
    if redis is None:
        raise RedisNotConfigured("the relayer needs REDIS_URL")
    return redis


@contextlib.contextmanager
def settlement_lock(redis: Redis, settlement_id: str) -> Iterator[Callable[[], bool] | None]:
    """Hold the settlement for this job; yields None if another live relayer holds it, else a function that
    says whether the lock is still ours (asks Redis: False if it cannot answer)."""
    key = JOB_LOCK_KEY.format(settlement_id)
    token = secrets.token_hex(8).encode()
    deadline = time.monotonic() + JOB_LOCK_SECONDS + 2  # a dead holder's lock expires by then
    while not redis.set(key, token, nx=True, ex=JOB_LOCK_SECONDS):
        if time.monotonic() > deadline:
            yield None
            return
        time.sleep(0.25)
    stop = threading.Event()

    def ours() -> bool:
        try:
            return bool(redis.get(key) == token)
        except RedisError:
            return False

    def renew() -> None:
        while not stop.wait(JOB_LOCK_SECONDS / 3):
            try:
                if redis.get(key) != token:
                    return
                redis.expire(key, JOB_LOCK_SECONDS)
            except RedisError:  # a Redis blip: tried again at the next renewal (the lock lasts three of them)
                continue

    renewer = threading.Thread(target=renew, name=f"lock-{settlement_id}", daemon=True)
    renewer.start()
    try:
        yield ours
    finally:
        stop.set()
        renewer.join(timeout=2)
        if redis.get(key) == token:
            redis.delete(key)


@dataclasses.dataclass(frozen=True)
class Handed:
    """A settlement taken from the intake list (backend.settlement.intake) for a settlement thread."""

    settlement_id: str
    request_id: str | None  # the /pay call's (or the reconciler's): the relayer's log lines for it carry it


def settle_handed(handed: Handed) -> None:
    """One settlement thread's work: :func:`settle_now`, logged with the request id that asked for it. An error
    leaves the settlement open: the reconciler pushes it again."""
    with logs.job_context(handed.request_id, f"settle-{handed.settlement_id}"):
        try:
            settle_now(handed.settlement_id)
        except Exception as exc:
            if not isinstance(exc, DomainError):  # a catalog error is logged by settle_now, without a traceback
                log.exception("settlement %s: failed", handed.settlement_id)


@app_job
def settle_now(settlement_id: str) -> str:
    redis = _redis()
    with settlement_lock(redis, settlement_id) as ours:
        if ours is None:
            return "already-being-settled"  # another relayer process is on it
        # Passing trouble is tried again here (SETTLE_RETRY_SECONDS); past that, or any other exception, propagates:
        # the settlement stays open (the reconciler sends it again) and /pay keeps waiting.
        try:
            outcome = _settle_retrying(settlement_id, redis, ours)
        except DomainError as err:  # a catalog error: a 5xx kind (CHAIN_UNAVAILABLE) is transient (retried above)
            (log.warning if err.http_status >= 500 else log.error)("settlement %s: %s %s", settlement_id, err.code, err)
            raise
    log.info("settlement %s: %s", settlement_id, outcome)
    notify_settled(redis, settlement_id)
    return outcome


def _transient(exc: BaseException) -> bool:
    """Passing trouble, not a decision: worth settling again soon (``SETTLE_RETRY_SECONDS``). A 4xx catalog error
    (the payment cannot succeed) and a failing statement are decisions or bugs: never retried."""
    if isinstance(exc, DomainError):
        return exc.http_status >= 500  # CHAIN_UNAVAILABLE, SERVICE_UNAVAILABLE
    if isinstance(exc, Exception) and database_unavailable(exc):  # "too many clients", a dropped connection, ...
        return True
    return isinstance(exc, RedisConnectionError | RedisTimeoutError) or rpc_unreachable(exc)


def _settle_retrying(settlement_id: str, redis: Redis, ours: Callable[[], bool]) -> str:
    """``_settle``, again after passing trouble (``_transient``) while the lock is still ``ours``, with a backoff,
    until SETTLE_RETRY_SECONDS have passed. Each try starts from what the database and the chain say then: the
    session is rolled back (what the failed try read or wrote is gone) and a sent settlement asks the chain
    first, so a finish that failed after the receipt records the payment, never sends it again."""
    give_up = time.monotonic() + SETTLE_RETRY_SECONDS
    delay = SETTLE_RETRY_FIRST_DELAY
    tries = 0
    while True:
        tries += 1
        try:
            return _settle(settlement_id, redis)
        except Exception as exc:
            if not _transient(exc) or time.monotonic() + delay > give_up:
                raise
            _end_transaction()
            # Loud once per settlement (a database outage meets every thread of every relayer), then quiet.
            (log.warning if tries == 1 else log.debug)("settlement %s: %s (try %d); trying again in %.1f s",
                                                       settlement_id, _briefly(exc), tries, delay)  # fmt: skip
            time.sleep(delay)
            if not ours():  # never settled again without the lock (it expired, or Redis cannot say)
                raise
        delay = min(delay * 2, SETTLE_RETRY_LONGEST_DELAY)


def _briefly(exc: BaseException) -> str:
    """An error in one line, without SQLAlchemy's statement and parameters (the retry's warning)."""
    cause = getattr(exc, "orig", None) or exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


def _end_transaction() -> None:
    """Roll the session back (a dropped connection's rollback may fail too: the session is then closed)."""
    try:
        db.session.rollback()
    except Exception:
        with contextlib.suppress(Exception):
            db.session.close()


def _read_settlement(settlement_id: str) -> st.Settlement | None:
    """The settlement as the database has it now, detached from the session, whose read transaction is ended:
    the chain calls that follow (RPCs, the waits for a receipt or confirmations) hold no database connection,
    so a relayer's threads share a pool smaller than their number (backend.app). Its attributes stay readable
    (a detached object is never expired); whatever it writes next goes through ``services`` by its id."""
    settlement = services.get_settlement(settlement_id)
    if settlement is not None:
        db.session.expunge(settlement)
    db.session.rollback()  # only reads so far (each write of the relayer commits)
    return settlement


def _settle(settlement_id: str, redis: Redis) -> str:
    settlement = _read_settlement(settlement_id)
    if settlement is None or settlement.status not in st.OPEN:
        return "finished"
    network = appstate.chains().get(settlement.network)
    keys = RELAY_KEYS.get(settlement.network)
    if network is None or keys is None:
        log.error("no relay account for %s; settlement %s waits", settlement.network, settlement_id)
        return "no-relay-account"
    rail = rail_for(network)
    # A retry first asks the chain what already happened. A fresh settlement (never sent) skips it:
    # /pay has just read the chain, and if anyone executed it since, the submit's checks (the estimate, the
    # simulation) fail and the chain is asked then.
    if settlement.status != st.PENDING:
        outcome = settle_from_chain(network, settlement)
        if outcome in FINISHED:
            return "finished-from-chain"
        if outcome is Outcome.NOT_FINAL:
            return "waiting-for-confirmations"  # executed, not final: nothing to send; the reconciler finishes it
    claim = settlement_claim(settlement)
    if settlement.status == st.SUBMITTED and claim.tx_id:
        status = rail.watch(network, [claim]).get(claim.tx_id)
        if status is not None and status.state in (TxState.SUCCEEDED, TxState.FAILED):
            return _finish(rail, network, settlement, claim, status)
        if status is not None and status.state is TxState.PENDING and not rail.resends_same_transaction and status.held:
            return "still-pending"  # our earlier transaction may still be mined: never send a second one
        # Not held but its recorded nonce unconsumed (EVM): the submit sends only at that nonce (never a new one).
        # Seen, not landed, on a rail whose send repeats the very same transaction (Solana: one signature): it is
        # sent again below, as a dropped broadcast would otherwise just expire (our sends ask for no retries).
    intent = db.session.get(Intent, settlement.intent_id, populate_existing=True)
    # A refund's settlement pays the buyer of an intent that is paid by design: never "paid by another".
    paid_by_another = (
        settlement.refund_id is None
        and intent is not None
        and intent.status == PAID
        and intent.settlement_id != settlement_id
    )
    db.session.rollback()  # the send's checks (RPCs) hold no connection; mark_submitted writes in a new transaction
    if paid_by_another:
        if _may_land_unwatched(rail, claim):
            return "waiting-for-chain"  # nothing sent, nothing released: the chain decides (the reconciler)
        services.fail_settlement(settlement_id, "ALREADY_PAID", "the intent was paid by another authorization")
        return "intent-already-paid"
    try:
        # The rail's last checks (the payer's code and validAfter on EVM, right before the send; the blockhash's
        # height, what the relay signs and the payee account on Solana), then the send; ``_submitted`` records
        # the transaction before it is broadcast.
        submission = rail.submit(network, claim, keys, redis, ledger_for(claim),
                                 lambda tx, address, nonce: _submitted(settlement_id, tx, address, nonce))  # fmt: skip
    except CannotSucceed as exc:
        # Final, not retried: the chain still decides first (someone may have executed it), in _reverted.
        return _reverted(rail, network, _read_settlement(settlement_id) or settlement, exc.reason, exc.code)
    except RelayRefuses as exc:  # nothing is sent now
        if exc.logged:
            log.error("settlement %s: %s", settlement_id, exc.logged)
        if _may_land_unwatched(rail, claim):
            return "waiting-for-chain"  # what the relay signed before may still land: the chain decides
        services.fail_settlement(settlement_id, exc.code, exc.reason)
        return exc.result
    except LeftOpen as exc:
        if exc.loud:  # our relay's trouble, never the payment's: said loudly
            log.error("settlement %s %s", settlement_id, exc)
        return exc.result  # left open: the reconciler sends it again once it is STALE_AFTER old
    except ChainDecides as exc:
        if exc.logged:
            log.warning("settlement %s: %s", settlement_id, exc.logged)
        if settle_from_chain(network, _read_settlement(settlement_id) or settlement) in FINISHED:
            return exc.finished_result
        return exc.result
    crash_point("after-broadcast")
    # The send's writes committed (its record before the broadcast); what it only read (Solana's payee ledger, when
    # the same signature went again and nothing was recorded) ends here: no connection is held across the wait.
    db.session.rollback()
    claim = dataclasses.replace(claim, tx_id=submission.tx_id, relay_address=submission.relay_address)
    # The fee bump records each replacement (and puts the row back) only while the row names what it replaces.
    landed = rail.wait_landed(network, claim, RECEIPT_TIMEOUT_SECONDS,
                              lambda old, tx, address, nonce: _rerecorded(settlement_id, old, tx, address,
                                                                          nonce))  # fmt: skip
    crash_point("before-finish")
    if landed is None:
        return "waiting-for-receipt"  # the reconciler finishes it
    claim = dataclasses.replace(claim, tx_id=landed.tx_id or claim.tx_id)
    return _finish(rail, network, _on_landed(settlement_id, claim.tx_id, submission) or settlement, claim, landed)


def _on_landed(settlement_id: str, tx_id: str | None, sent: Submission) -> st.Settlement | None:
    """The settlement row, naming the transaction that landed with its own relay account and nonce (``sent``'s: a
    replacement at the nonce shares them). A replacement (EVM fee bump) re-points the row at each new hash, so the
    one mined may be an earlier one; after a lock loss another attempt may have recorded its own transaction
    elsewhere (it can only revert now: the authorization is used). The row is re-pointed at the mined one (at its
    own nonce: the row held it, or held it until the other record, so migration 0012's index holds no other open
    row there) before ``_finish``, ``_reverted`` (the revert's finality wait reads the row's hash) and the
    reconciler read it. Read as ``_read_settlement`` reads (detached, no transaction held across the waits)."""
    row = _read_settlement(settlement_id)
    if row is None or not tx_id or sent.relay_nonce is None:
        return row  # not a nonce-replaced transaction (only EVM replaces, and it records the nonce)
    mined = (tx_id.lower(), sent.relay_address.lower(), sent.relay_nonce)
    if (str(row.tx_hash).lower(), str(row.relay_address).lower(), row.relay_nonce) == mined:
        return row
    services.mark_submitted(settlement_id, tx_id, sent.relay_address, relay_nonce=sent.relay_nonce)
    return _read_settlement(settlement_id) or row


def _may_land_unwatched(rail: Rail, claim: Claim) -> bool:
    """Whether releasing the claim now could let a payment go unrecorded: a transaction of ours for it was
    signed (the chain was asked first: it has not landed, and may still) and this rail does not watch released
    settlements (Solana). Such a settlement stays open until the chain decides: landed → paid (a duplicate
    payment if the intent is paid by then), can never land (its blockhash expired) → failed."""
    return claim.tx_id is not None and not rail.released_may_execute()


def _submitted(settlement_id: str, tx_id: str, relay_address: str, relay_nonce: int | None) -> None:
    services.mark_submitted(settlement_id, tx_id, relay_address, relay_nonce=relay_nonce)
    crash_point("after-mark-submitted")


def _rerecorded(settlement_id: str, expect_tx: str, tx_id: str, relay_address: str, relay_nonce: int) -> bool:
    """The EVM fee bump's record at its nonce (``Rerecord``): only while the row still names ``expect_tx`` there."""
    written = services.mark_submitted(settlement_id, tx_id, relay_address, relay_nonce=relay_nonce,
                                      expect_tx=expect_tx)  # fmt: skip
    crash_point("after-mark-submitted")
    return written


def _finish(rail: Rail, network: Network, settlement: st.Settlement, claim: Claim, status: TxStatus) -> str:
    """Our transaction landed (``status``): paid once final, else the revert decided (``_reverted``)."""
    tx_id = claim.tx_id or ""
    # What our transaction cost, to the merchant's relay budget (reverted or not), before anything else.
    if status.cost:
        relaybudget.charge(settlement.merchant_id, settlement.network, rail.spend_kind, status.cost, tx_id,
                           settlement.id)  # fmt: skip
    if status.state is TxState.SUCCEEDED:
        if status.final:  # mined is final on this network (one confirmation; Solana: confirmed)
            return "confirmed" if paid(rail, network, claim, tx_id) else "waiting-for-confirmations"
        if not rail.wait_final(network, status, RECEIPT_TIMEOUT_SECONDS):
            return "waiting-for-confirmations"  # the reconciler finishes it once final
        # The chain's height passing the receipt's block proves nothing if a reorg dropped that block
        # while we waited: the chain decides again, with the log and its finality read now.
        outcome = settle_from_chain(network, settlement)
        if outcome is Outcome.USED:
            return "confirmed"
        if outcome in FINISHED:
            return "finished-from-chain"
        return "waiting-for-confirmations" if outcome is Outcome.NOT_FINAL else "reorged-out"
    return _reverted(rail, network, settlement, f"transaction {tx_id} reverted")


def _reverted(
    rail: Rail, network: Network, settlement: st.Settlement, reason: str, code: str = "SETTLEMENT_FAILED"
) -> str:
    """A revert: the chain decides (someone may have executed or cancelled it); else release the intent.

    Not while our own transaction's revert is in a block that is not final: a reorg may still replace
    that block and mine our transaction alone, and then it succeeds, after the intent was released (and
    perhaps paid again). The revert is waited for up to its confirmations, then decided again.
    """
    for _ in range(2):
        claim = settlement_claim(settlement)
        # The height is read before the receipt (its block is final only if buried at that height).
        status = rail.watch(network, [claim]).get(claim.tx_id) if claim.tx_id else None
        outcome = settle_from_chain(network, settlement)
        if outcome in FINISHED:
            return "finished-from-chain"
        if outcome is Outcome.NOT_FINAL:
            return "waiting-for-confirmations"  # executed (by anyone), not final: never release it now
        if status is None or status.state is TxState.UNKNOWN:
            break  # none of our transactions for it is mined or pending
        if status.state is TxState.PENDING:
            return "still-pending"
        if status.state is TxState.SUCCEEDED:
            return "waiting-for-confirmations"  # mined after all (a reorg): the chain decides once its log is final
        if status.final:
            break
        if not rail.wait_final(network, status, RECEIPT_TIMEOUT_SECONDS):
            return "waiting-for-confirmations"  # the reconciler sends it back to us; decided once final
    else:
        return "waiting-for-confirmations"  # the block moved under us while we waited: decide next time
    services.fail_settlement(settlement.id, code, reason)
    return "reverted" if code == "SETTLEMENT_FAILED" else code.lower()
