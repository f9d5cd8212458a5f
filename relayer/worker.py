"""``payintent relayer``: an RQ worker on the relayer queue, the only process holding relay keys."""

from __future__ import annotations

import logging

from flask import Flask
from redis import Redis

from backend.chains.evm import evm_chain
from backend.chains.registry import Network
from backend.observability.logs import register_secret
from backend.queueing import set_job_app, work
from relayer import tasks
from relayer.keys import RelayKeyError, load_relay_accounts, load_solana_relays

log = logging.getLogger(__name__)


def run_relayer(app: Flask, connection: Redis, *, burst: bool = False) -> None:
    accounts = load_relay_accounts(app.extensions["payintent.chains"])
    register_secret(*(account.key.hex() for loaded in accounts.values() for account in loaded))  # never logged
    tasks.RELAY_ACCOUNTS.clear()
    tasks.RELAY_ACCOUNTS.update(accounts)
    registry = app.extensions["payintent.chains"]
    tasks.SOLANA_RELAYS.clear()
    tasks.SOLANA_RELAYS.update(load_solana_relays(registry))
    register_secret(*(str(keypair) for keypair in tasks.SOLANA_RELAYS.values()))  # its base58 secret
    for network_id, keypair in tasks.SOLANA_RELAYS.items():
        log.info("relayer: fee payer %s on %s", keypair.pubkey(), network_id)
    for network, loaded in accounts.items():
        check_chain_id(registry.get(network))
        log.info("relayer: %d relay account(s) on %s: %s", len(loaded), network, ", ".join(a.address for a in loaded))
    set_job_app(app)
    settings = app.config["PAYINTENT_SETTINGS"]
    work([settings.relayer_queue], connection, burst=burst, logging_level=settings.log_level)


def check_chain_id(network: Network | None) -> None:
    """Refuse to sign for a network whose RPC answers with another chain id (a misconfigured URL)."""
    if network is None:
        return
    try:
        answered = evm_chain(network).w3.eth.chain_id
    except Exception as exc:
        log.warning("relayer: %s unreachable at start-up (%s); will retry per job", network.network, type(exc).__name__)
        return
    if answered != network.chain_id:
        raise RelayKeyError(f"the RPC of {network.network} answers chain id {answered}, not {network.chain_id}")


def run_pool(processes: int, argv: list[str]) -> int:
    """Supervise ``processes`` relayer processes (one job at a time each), restarting any that dies.

    Each job leases a free relay account of its chain, so N processes use up to N accounts of a
    chain in parallel. SIGTERM/SIGINT stop them all.
    """
    import signal
    import subprocess
    import time

    children: list[subprocess.Popen[bytes] | None] = [subprocess.Popen(argv) for _ in range(processes)]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
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
