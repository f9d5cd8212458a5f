"""Observability of the api, worker and relayer: JSON logs with request ids, /metrics, /readyz.

- ``logs``: the log handler (JSON or text), request ids on every line, the redaction of secrets.
- ``hooks``: ``init_app`` (called first in ``create_app``): logging, request ids, latency per route.
- ``metrics``: the metric objects and the collectors that read state when scraped.
- ``chains``: RPC probes of the configured chains (short timeouts, cached answers).
- ``health``, ``views``: ``/readyz`` and ``/metrics``.
- ``gunicorn_conf``: ``payintent serve``'s gunicorn settings (multiprocess metrics, logging).

This module imports nothing: gunicorn's master imports ``gunicorn_conf`` through it, and must not
load prometheus_client before ``gunicorn_conf`` has set ``PROMETHEUS_MULTIPROC_DIR``.
See docs/observability.md.
"""
