"""``payintent relayer``: an RQ worker on the relayer queues of its networks, the only process holding relay keys.

Each network has its own queue (``RELAYER_QUEUE:<network>``, backend.queueing.relayer_queue). A
relayer listens on the queues of the networks it holds keys for, narrowed by RELAYER_NETWORKS: one
relayer per chain is a relayer with RELAYER_NETWORKS set to that chain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from flask import Flask, has_app_context
from redis import Redis

from backend import appstate
from backend.logs import register_secret
from backend.queueing import app_redis, relayer_queue, set_job_app, stop_requested, work
from backend.rails.evm import accounts, identity, pipeline
from backend.rails.registry import rail_for
from backend.settlement import services as settlement_services
from relayer import faults, tasks
from relayer.keys import RelayKeyError, load_relay_keys
from relayer.pool import SettlementPool, finish_in_flight

log = logging.getLogger(__name__)


def run_relayer(app: Flask, connection: Redis, *, burst: bool = False, threads: int | None = None) -> None:
    """Settle the relayer queues' jobs, ``threads`` (default RELAYER_THREADS) settlements at a time."""
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
    with app.app_context():
        app_redis()  # made once here, not by several settlement threads at once
    threads = threads or settings.relayer_threads
    # Before the first lease: a relayer restarted in a dead one's slot takes its relay accounts back at once.
    state_dir = settings.relayer_state_dir
    accounts.use_identity(identity.claim(Path(state_dir) if state_dir else None))
    pool = tasks.POOL = SettlementPool(threads, tasks.settle_handed)
    log.info("relayer: listening on %s with %d settlement thread(s)", ", ".join(queues), threads)
    try:
        work(queues, connection, burst=burst, logging_level=settings.log_level)
        finish_in_flight(pool, stopped=stop_requested())
    finally:
        tasks.POOL = None
        accounts.release_all()  # a clean stop frees its relay accounts for any relayer at once


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
