"""The relay budget's Prometheus counters, counted where a payment is refused (``backend.relaybudget.services``);
the api's ``/metrics`` shows them with every other metric (``backend.observability.metrics``)."""

from __future__ import annotations

from prometheus_client import Counter

# Counted where the refusal happens: ``endpoint`` "pay" (a signed payment at /pay) or "prepare" (the public,
# unauthenticated Solana transaction call, which anyone may make refuse: not a signal of an attack). By
# network, not merchant: a merchant label would add series for every merchant that ever signs up (and put
# merchant ids in the monitoring system); who is refused is in the api's warning log lines and the
# relay_spending table.
RELAY_BUDGET_REFUSALS = Counter(
    "payintent_relay_budget_refusals",
    "Payments refused with RELAY_BUDGET_EXHAUSTED (a merchant's relay budget on the network was used up, counting "
    "what its open settlements may still cost), by network and endpoint (pay: a signed payment; prepare: the "
    "public Solana transaction call)",
    ["network", "endpoint"],
)
OPEN_SETTLEMENT_REFUSALS = Counter(
    "payintent_open_settlement_refusals",
    "Payments refused with TOO_MANY_OPEN_SETTLEMENTS (a merchant had MAX_OPEN_SETTLEMENTS payments on the network "
    "still settling), by network and endpoint",
    ["network", "endpoint"],
)
