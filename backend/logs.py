"""Logs: one JSON object per line (or readable text), the request id on every line, secrets redacted.

:func:`configure_logging` puts one handler on the root logger of the api, worker and relayer
(``create_app`` calls it; gunicorn's and RQ's loggers propagate to it). Every record passes its
filters: :class:`QuietRQFilter` makes RQ's per-job lines DEBUG, :class:`ContextFilter` adds the
request id (the api request's, or the one an RQ job was enqueued with, so a settlement's relayer
lines carry the /pay call's id) and :class:`RedactionFilter` scrubs what must never be written:
API keys, webhook secrets, bearer tokens and Authorization values, passwords, URL credentials, and
the literal secrets registered with :func:`register_secret` (relay keys, RPC URLs, which may embed
a provider key).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from flask import g, has_request_context
from rq.job import get_current_job

REQUEST_ID_HEADER = "X-Request-Id"
# An incoming X-Request-Id is kept only if it is a sane token; anything else is replaced.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
FORMATS = ("json", "text")
# Fields a record may carry (``extra=``) that the JSON formatter writes after the fixed ones.
FIELDS = ("method", "route", "status", "duration_ms", "job_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def valid_request_id(value: str | None) -> str | None:
    return value if value and _REQUEST_ID.fullmatch(value) else None


def running() -> tuple[str | None, str | None]:
    """(request id, job id) of what this thread runs: an api request, an RQ job (with its enqueuer's request id),
    or work handed to it with a :func:`job_context` (the relayer's settlement threads)."""
    if has_request_context():
        return g.get("request_id"), None
    job = get_current_job()
    if job is not None:
        return job.meta.get("request_id"), job.id
    return _handed.get()


# The request and job ids a thread works for when its work was handed to it (the relayer's settlement threads,
# given a settlement from its intake list): RQ's own current job is the worker thread's only.
_handed: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar("handed", default=(None, None))


@contextlib.contextmanager
def job_context(request_id: str | None, job_id: str | None = None) -> Iterator[None]:
    """Log lines written in here carry ``request_id`` (the call that asked for the work) and ``job_id``."""
    token = _handed.set((request_id, job_id))
    try:
        yield
    finally:
        _handed.reset(token)


def current_request_id() -> str | None:
    return running()[0]


# --- redaction -----------------------------------------------------------------------------------

_REDACTED = "[redacted]"
# A value named like a secret: password=..., "webhook_secret": "...", SECRET_KEY: ..., private_key=...
_NAMED_SECRET = re.compile(
    r"(?i)((?:password|passwd|secret|private_?key|api_?key)[\w-]*[\"']?\s*[:=]\s*[\"']?)[^\[\"'\s,;&}\]]+"
)
# What a secret looks like, whatever code logged it: first values named as secrets (all of the value
# goes), then secrets known by their shape. Each pattern runs only if one of its triggers (lower
# case) is in the text, so most lines cost a few substring checks. Each replacement leaves text no
# pattern matches again, so redacting twice changes nothing.
_PATTERNS: tuple[tuple[tuple[str, ...], re.Pattern[str], str], ...] = (
    (
        ("authorization",),
        re.compile(r"(?i)\b(authorization[\"']?\s*[:=]\s*[\"']?)(?:(?:bearer|basic|token)\s+)?[^\[\s\"',}]+"),
        r"\1" + _REDACTED,
    ),
    (("passw", "secret", "private_key", "privatekey", "api_key", "apikey"), _NAMED_SECRET, r"\1" + _REDACTED),
    # API keys keep the 6 characters the dashboard lists (their display prefix), never more.
    (("sk_",), re.compile(r"\b(sk_(?:test|live)_[A-Za-z0-9]{6})[A-Za-z0-9]+"), r"\1…"),
    (("whsec_",), re.compile(r"\bwhsec_[A-Za-z0-9+/=_-]+"), "whsec_" + _REDACTED),
    (("bearer",), re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+"), r"\1 " + _REDACTED),
    # user:password@ in any URL (database, Redis, an RPC with basic auth).
    (("@",), re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@\s/\[]+@"), r"\1" + _REDACTED + "@"),
)
# The registered literal secrets and one pattern finding any of them (swapped together, never torn).
_literals: tuple[tuple[str, ...], re.Pattern[str]] = ((), re.compile(r"(?!)"))
_literals_lock = threading.Lock()


def register_secret(*values: str | None) -> None:
    """Never log these strings (relay keys, RPC URLs and their paths): each is replaced wherever it appears."""
    global _literals
    with _literals_lock:
        known = _literals[0]
        added = {v for v in values if v and len(v) >= 8} - set(known)
        if added:
            ordered = tuple(sorted({*known, *added}, key=len, reverse=True))  # a URL before its path
            _literals = (ordered, re.compile("|".join(re.escape(v) for v in ordered)))


def register_rpc_urls(urls: Iterable[str | None]) -> None:
    """RPC URLs may carry a provider key in their path, query or user info: never log them, nor their path."""
    from urllib.parse import urlsplit

    for url in urls:
        if not url:
            continue
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        register_secret(url, path if len(path) > 1 else None, parts.password)


def redact(text: str) -> str:
    lower = text.lower()
    for triggers, pattern, replacement in _PATTERNS:
        if any(trigger in lower for trigger in triggers):
            text = pattern.sub(replacement, text)
    literals, any_literal = _literals
    if any(literal in text for literal in literals):
        text = any_literal.sub(_REDACTED, text)
    return text


_plain = logging.Formatter()


class RedactionFilter(logging.Filter):
    """Rewrites the record's message and traceback with secrets redacted (the safety net)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_redacted", False):
            return True
        record.msg = redact(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = _plain.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        record._redacted = True
        return True


class ContextFilter(logging.Filter):
    """Adds ``request_id`` (and ``job_id`` inside an RQ job) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id, job_id = running()
            if job_id is not None:
                record.job_id = job_id
        return True


class QuietRQFilter(logging.Filter):
    """RQ logs three or four INFO lines per job (taken, done, result kept), so an idle ``make run``, whose
    worker runs a periodic job every 2 s, printed about 80 lines per 30 s. Those lines are DEBUG here: shown
    with LOG_LEVEL=DEBUG (RQ's loggers then take DEBUG records), dropped otherwise. RQ's lines about the
    worker itself (started, listening on, stopping) stay INFO, as do its warnings and errors."""

    LIFECYCLE = frozenset({"bootstrap", "work", "handle_warm_shutdown_request", "check_for_suspension"})

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not record.name.startswith("rq.") or record.funcName in self.LIFECYCLE:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


# --- formatters ----------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", "request_id", ...fields, "exc"}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None) is None:
            record.request_id = "-"
        return super().format(record)


# --- the handler ---------------------------------------------------------------------------------


class StderrHandler(logging.StreamHandler[Any]):
    """Writes to whatever ``sys.stderr`` is at the time (gunicorn and pytest replace it)."""

    _payintent = False  # True on the handler configure_logging installs

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def make_handler(fmt: str = "json") -> logging.Handler:
    if fmt not in FORMATS:
        raise ValueError(f"LOG_FORMAT must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(QuietRQFilter())
    handler.addFilter(ContextFilter())
    handler.addFilter(RedactionFilter())
    handler._payintent = True
    return handler


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """One handler of ours on the root logger (replacing any earlier one of ours); idempotent."""
    root = logging.getLogger()
    handler = make_handler(fmt)
    for old in [h for h in root.handlers if getattr(h, "_payintent", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
