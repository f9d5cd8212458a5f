"""Prometheus metrics of the whole service, exposed by the api at ``/metrics``.

Two kinds:

- **Request latency** (:data:`REQUEST_DURATION`), observed by each api process as it answers, and
  relay-budget refusals (``backend.relaybudget.metrics``), counted where they happen. Under ``payintent serve``
  gunicorn's workers write them to files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess
  mode, set up by ``backend.observability.gunicorn_conf``) and a scrape, whichever worker answers it, sums them
  all. Without that variable (tests, a single process) they live in the process.
- **State** (:class:`StateCollector`), read when scraped: settlements by network and status,
  webhook deliveries by status and what the relay spent for merchants (database), queue depths
  (Redis), relay gas balances (each chain's RPC, cached). What the worker and relayer did is in
  those, so they serve no metrics themselves. A scrape runs a handful of cheap queries; nothing
  is counted on the request path but latency and refusals.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from collections.abc import Iterable, Iterator
from datetime import datetime

from flask import Flask
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from backend import appstate, clock
from backend.extensions import db
from backend.queueing import DEFAULT_QUEUE, app_redis, queue, relayer_queue
from backend.relaybudget.services import totals as relay_spending
from backend.settlement import intake
from backend.settlement.services import oldest_open_at, settlement_counts
from backend.webhooks.models import DELIVERY_STATUSES
from backend.webhooks.services import delivery_counts, oldest_due_at
from backend.webhooks.tasks import WEBHOOK_QUEUE

log = logging.getLogger(__name__)
disable_created_metrics()  # no *_created series: Prometheus does not need them, and they double the output

REQUEST_DURATION = Histogram(
    "payintent_http_request_duration_seconds",
    "Time the api took to answer, by method, route (the URL rule, e.g. /api/v1/x402/intents/<intent_id:intent_id>; "
    "'unmatched' for unknown paths) and status code",
    ["method", "route", "status"],
    # /pay waits for the chain up to PAY_WAIT_SECONDS (30 s by default).
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class _Collected:
    """A registry's collectors, as one collector of another registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect()


class StateCollector:
    """Reads the database, Redis and the chains when scraped (inside the /metrics request's app context)."""

    def __init__(self, app: Flask) -> None:
        self.app = app

    def describe(self) -> list[Metric]:
        return []  # nothing to read at registration

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "payintent_metrics_source_up", "Whether a scrape could read the source (database, redis)", labels=["source"]
        )
        for source, read in (("database", self._database), ("redis", self._queues)):
            try:
                families = list(read())
            except Exception as exc:
                log.warning("metrics: could not read the %s (%s)", source, type(exc).__name__)
                up.add_metric([source], 0)
                continue
            up.add_metric([source], 1)
            yield from families
        yield up
        yield from self._gas()

    def _database(self) -> Iterator[Metric]:
        try:
            now = clock.now()
            settlements, oldest_settlement = settlement_counts(), oldest_open_at()
            deliveries, oldest_delivery = delivery_counts(), oldest_due_at(now)
            spending = relay_spending()
        finally:
            db.session.rollback()  # end the read transaction whatever happened
        family = GaugeMetricFamily(
            "payintent_settlements",
            "Settlements by network and status (pending, submitted: in flight; confirmed, failed: outcomes)",
            labels=["network", "status"],
        )
        for (network, status), count in sorted(settlements.items()):
            family.add_metric([network, status], count)
        yield family
        yield _age(
            "payintent_settlement_oldest_open_seconds",
            "Age of the oldest settlement still in flight (pending or submitted; 0: none is)",
            now,
            oldest_settlement,
        )
        family = GaugeMetricFamily(
            "payintent_webhook_deliveries",
            "Webhook deliveries by status (pending: waiting for an attempt; succeeded, failed, cancelled: outcomes)",
            labels=["status"],
        )
        for status in DELIVERY_STATUSES:
            family.add_metric([status], deliveries.get(status, 0))
        yield family
        spent = CounterMetricFamily(
            "payintent_relay_spent",
            "What the relay paid to settle merchants' payments, by network and kind (gas: EVM gas; fee: Solana "
            "transaction fees), in the network's smallest native unit (wei, lamports); from the relay_spending ledger",
            labels=["network", "kind"],
        )
        for (network, kind), total in sorted(spending.items()):
            spent.add_metric([network, kind], total)
        yield spent
        yield _age(
            "payintent_webhook_oldest_due_seconds",
            "How long the longest-waiting due webhook delivery has been due (0: none is waiting)",
            now,
            oldest_delivery,
        )

    def _queues(self) -> Iterator[Metric]:
        redis = app_redis(fast=True)
        if redis is None:
            raise RuntimeError("REDIS_URL is not set")
        base = appstate.settings(self.app).relayer_queue
        family = GaugeMetricFamily(
            "payintent_queue_depth",
            f"Work waiting in each queue ({base}:<network>: settlements on that network's relayer intake list; "
            f"{DEFAULT_QUEUE}, {WEBHOOK_QUEUE}: the worker's)",
            labels=["queue"],
        )
        for network in appstate.chains(self.app):  # a relayer's list: the settlements it has not taken yet
            family.add_metric([relayer_queue(base, network.network)], intake.depth(redis, base, network.network))
        for name in dict.fromkeys((DEFAULT_QUEUE, WEBHOOK_QUEUE)):
            family.add_metric([name], queue(name, redis).count)
        yield family

    def _gas(self) -> Iterator[Metric]:
        probes = appstate.observability(self.app).probes
        balances = GaugeMetricFamily(
            "payintent_relay_gas_balance",
            "Native coin (ETH, SOL) held by each relay account to pay gas and fees, from the chains file's "
            "relay_addresses / fee_payer (read at most every 30 s)",
            labels=["network", "address"],
        )
        rpc_up = GaugeMetricFamily(
            "payintent_relay_gas_rpc_up", "Whether the last read of the relay gas balances answered", labels=["network"]
        )
        for network, (outcome, found) in sorted(probes.gas_balances().items()):
            rpc_up.add_metric([network], 1 if outcome.ok else 0)
            for address, balance in sorted((found or {}).items()):
                balances.add_metric([network, address], float(balance))
        yield balances
        yield rpc_up


def _age(name: str, documentation: str, now: datetime, since: datetime | None) -> Metric:
    return GaugeMetricFamily(name, documentation, value=max((now - since).total_seconds(), 0.0) if since else 0.0)


class _WorkersCollector(MultiProcessCollector):
    """Every gunicorn worker's metric files, less the ones still empty: a worker that is booting creates its file
    and only then sizes it, and prometheus_client's reader fails on an empty file (struct.error: a 500 for
    /metrics while a worker starts, seen in CI with three gthread workers booting)."""

    def collect(self) -> Iterable[Metric]:
        files = []
        for path in glob.glob(os.path.join(self._path, "*.db")):
            with contextlib.suppress(OSError):  # gone meanwhile (a worker's files removed when it exits)
                if os.path.getsize(path) > 0:
                    files.append(path)
        merged: Iterable[Metric] = self.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
        return merged


def scrape_registry(app: Flask) -> CollectorRegistry:
    """What /metrics shows for ``app``: request latency (all gunicorn workers' in multiprocess mode) and state."""
    registry = CollectorRegistry(auto_describe=False)
    if multiprocess_dir():
        _WorkersCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry.register(_Collected(REGISTRY))
    registry.register(StateCollector(app))
    return registry
