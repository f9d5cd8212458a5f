"""``payintent relayer``: takes settlements off the intake lists of its networks; the only process holding relay keys.

Each network has its own list (``payintent:intake:RELAYER_QUEUE:<network>``, backend.settlement.intake). A
relayer takes from the lists of the networks it holds keys for, narrowed by RELAYER_NETWORKS: one
relayer per chain is a relayer with RELAYER_NETWORKS set to that chain.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from flask import Flask, has_app_context
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backend import appstate
from backend.logs import register_secret
from backend.queueing import (
    app_redis,
    relayer_queue,
    set_job_app,
    stop_flag_on_signals,
    stop_requested,
    stop_signal_times,
    wait_for_redis,
)
from backend.rails.evm import accounts, identity, pipeline
from backend.rails.registry import rail_for
from backend.settlement import intake
from backend.settlement import services as settlement_services
from relayer import faults, tasks
from relayer.keys import RelayKeyError, load_relay_keys
from relayer.pool import SettlementPool, finish_in_flight

log = logging.getLogger(__name__)

# How long one BLPOP waits for a settlement: a stop signal is acted on within about this long.
TAKE_BLOCK_SECONDS = 1.0
# After an error reply to a pop (READONLY, OOM, BUSY; Redis answers, so wait_for_redis would not wait).
REDIS_ERROR_PAUSE = 1.0


def run_relayer(app: Flask, connection: Redis, *, burst: bool = False, threads: int | None = None) -> None:
    """Settle what the intake lists of its networks bring, ``threads`` (default RELAYER_THREADS) settlements at a
    time, until a stop signal (SIGTERM, SIGINT, SIGHUP) or, ``burst``, until the lists are empty; then the
    settlements in progress get their grace (relayer.pool.finish_in_flight)."""
    settings = appstate.settings(app)
    registry = appstate.chains(app)
    chosen = set(settings.relayer_networks)
    unknown = sorted(n for n in chosen if registry.get(n) is None)
    if unknown:
        raise RelayKeyError(f"RELAYER_NETWORKS names networks the chains file does not have: {', '.join(unknown)}")
    keys = {n: k for n, k in load_relay_keys(registry).items() if not chosen or n in chosen}
    missing = sorted(chosen - set(keys))
    if missing:
        raise RelayKeyError(f"no relay keys for {', '.join(missing)} (named in RELAYER_NETWORKS)")
    register_secret(*(secret for loaded in keys.values() for secret in loaded.secrets()))  # never logged
    for loaded in keys.values():
        # A rail whose relay starts its nonces after the ones settlements recorded (EVM) is told how to read them.
        loaded.use_recorded_nonces(_in_app(app, settlement_services.max_relay_nonce))
    tasks.RELAY_KEYS.clear()
    tasks.RELAY_KEYS.update(keys)
    for network_id, loaded in keys.items():
        network = registry.get(network_id)
        assert network is not None  # load_relay_keys skips networks the chains file does not have
        rail_for(network).check_relay_network(network)
        log.info("relayer: %s", loaded.summary(network_id))
    set_job_app(app)
    pipeline.AFTER_WAKE = faults.after_watch_block  # a crash point (PAYINTENT_FAULT), tests and drills only
    networks = sorted(keys)
    if not networks:
        if burst:
            log.warning("relayer: no relay keys for any configured network; nothing to settle")
            return
        raise RelayKeyError("no relay keys for any configured network (RELAY_KEYS, RELAY_KEYS_FILE)")
    queues = [relayer_queue(settings.relayer_queue, network) for network in networks]
    lists = [intake.list_key(settings.relayer_queue, network) for network in networks]
    with app.app_context():
        app_redis()  # made once here, not by several settlement threads at once
    threads = threads or settings.relayer_threads
    # Before the first lease: a relayer restarted in a dead one's slot takes its relay accounts back at once.
    state_dir = settings.relayer_state_dir
    accounts.use_identity(identity.claim(Path(state_dir) if state_dir else None))
    pool = SettlementPool(threads, tasks.settle_handed)
    presence = intake.Presence(connection, queues, lists)  # readiness: it takes settlements from now on
    log.info("relayer: listening on %s with %d settlement thread(s)", ", ".join(queues), threads)
    try:
        with stop_flag_on_signals():
            _take(pool, connection, lists, burst=burst)
            finish_in_flight(pool, stopped=stop_requested(), signals=stop_signal_times())
    finally:
        presence.close()
        accounts.release_all()  # a clean stop frees its relay accounts for any relayer at once


def _take(
    pool: SettlementPool, connection: Redis, lists: list[str], *, burst: bool, stop: Callable[[], bool] = stop_requested
) -> None:
    """Hand settlements from ``lists`` to ``pool``'s threads until a stop signal or, ``burst``, empty lists.

    A free thread is reserved before anything is popped, so each popped settlement has a thread waiting for it
    and a stop never leaves one taken and not handed over. After the first (BLPOP, TAKE_BLOCK_SECONDS), as many
    more as there are free threads are taken without waiting. Redis gone: waited for (wait_for_redis), then on;
    an error reply (READONLY, OOM, BUSY): the same after a short pause, so the threads in flight keep their grace;
    a settlement thread's own Redis calls retry meanwhile (relayer.tasks). ``burst`` ends on a Redis loss.
    ``stop``: whether to stop (a stop signal, by default)."""
    order = list(lists)
    while not stop():
        if not pool.reserve(0.5):
            continue  # every thread busy: the lists keep what this process cannot start
        reserved = 1 + pool.reserve_more(pool.size - 1)
        order = order[1:] + order[:1]  # each network's list first in turn: none waits behind another's
        try:
            items, taken = intake.pop(connection, order, reserved, block=None if burst else TAKE_BLOCK_SECONDS)
        except RedisError as exc:  # lost, or an error reply (READONLY after a failover, OOM, BUSY): wait, go on
            pool.unreserve(reserved)
            if burst:
                raise
            if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
                log.warning("relayer: lost Redis (%s); waiting for it, then going on", type(exc).__name__)
                wait_for_redis(connection, until=stop)
            else:  # Redis answers, with an error: a pause, not a busy loop of failing pops
                log.warning("relayer: Redis refused the pop (%s); trying again in %.0f s", exc, REDIS_ERROR_PAUSE)
                _pause(REDIS_ERROR_PAUSE, stop)
            continue
        for item in items:
            pool.hand(tasks.Handed(item.settlement_id, item.request_id))
        pool.unreserve(reserved - len(items))
        if burst and not taken:  # not ``items``: a pop of only unreadable items is no empty list
            return


def _pause(seconds: float, stop: Callable[[], bool]) -> None:
    deadline = time.monotonic() + seconds
    while not stop() and time.monotonic() < deadline:
        time.sleep(0.1)


def run_pool(processes: int, argv: list[str]) -> int:
    """Supervise ``processes`` relayer processes (each with its settlement threads), restarting any that dies.

    Each process leases relay accounts of its chain for its lifetime (backend/rails/evm/accounts.py), so N
    processes use up to N accounts of a chain in parallel, each with many transactions in flight. One process with
    threads (RELAYER_THREADS) is the usual shape; several suit a relayer whose one process is CPU-bound. SIGTERM,
    SIGINT or SIGHUP stops them all.
    """
    import signal
    import subprocess
    import time

    children: list[subprocess.Popen[bytes] | None] = [subprocess.Popen(argv) for _ in range(processes)]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    delays = [1.0] * processes
    try:
        while not stopping and any(child is not None for child in children):
            for i, child in enumerate(children):
                if child is None or child.poll() is None or stopping:
                    continue
                if child.returncode == 0:  # a clean exit (e.g. --burst drained the queue): not restarted
                    children[i] = None
                    continue
                log.warning("relayer process %d exited with %s; restarting in %.0fs", child.pid, child.returncode,
                            delays[i])  # fmt: skip
                time.sleep(delays[i])
                delays[i] = min(delays[i] * 2, 60.0)
                children[i] = subprocess.Popen(argv)
            time.sleep(0.5)
    finally:
        alive = [child for child in children if child is not None]
        for child in alive:
            if child.poll() is None:
                child.terminate()
        for child in alive:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    return 0


def _in_app(app: Flask, read: Callable[[str, str], int | None]) -> Callable[[str, str], int | None]:
    """``read`` in ``app``'s context, pushed when the caller has none (the relay pool's repair thread adopting a
    dead relayer's account reads the recorded nonces there; a settlement thread already has one)."""

    def in_app(network: str, address: str) -> int | None:
        if has_app_context():
            return read(network, address)
        with app.app_context():
            return read(network, address)

    return in_app
