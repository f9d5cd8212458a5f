"""CSV export of a merchant's intents: the list's filters plus a creation-time range, read in batches, streamed.

The rows are read newest first in batches of :data:`BATCH_SIZE` with keyset pagination over
``(created_at desc, id desc)`` (each batch walks ``ix_intents_merchant_created`` from where the previous one
stopped: no OFFSET, however large the export), with the list's own filter logic (``services._status_condition``:
an overdue pending intent is expired). Each batch is written to a small buffer with :mod:`csv` and handed on as
one chunk; the read transaction ends after each batch, so a client that downloads slowly holds no database
connection between batches.

Cells are plain text: amounts a decimal string (``from_atomic``, never a float), times as the API shows them
(``clock.isoformat``), metadata compact JSON. A text cell that a spreadsheet would read as a formula (it starts
with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return: OWASP's "CSV injection") gets a leading ``'``.
"""

from __future__ import annotations

import csv
import io
import itertools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flask import Response, current_app, stream_with_context
from sqlalchemy import RowMapping, select

from backend import clock
from backend.errors import validation_error
from backend.extensions import db
from backend.intents.services import _COLUMNS, _intents, _status_condition, effective_status
from backend.jsonio import dumps
from backend.money import from_atomic
from backend.ratelimit import enforce

CSV = "text/csv"
BATCH_SIZE = 500  # rows per query and per chunk written (read at each export: tests lower it)

HEADER = (
    "intent_id", "status", "amount_usdc", "chain", "tx_hash", "buyer_address", "created_at", "paid_at",
    "expires_at", "order_id", "description", "payment_link_id", "metadata", "refunded_usdc",
)  # fmt: skip

# What the export reads: the list's columns but the wide ones it does not show (the requirements, the URLs).
_EXPORT_COLUMNS = tuple(c for c in _COLUMNS if c.name not in {"payment_requirements", "redirect_url", "cancel_url"})

# OWASP, "CSV Injection": a cell starting with one of these is a formula (or becomes one) to a spreadsheet; so is
# one starting with spaces then one of them, or with a full-width form. A cell starting with ' is escaped too, so
# that removing exactly one leading ' always gives the stored value back.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_FORMULA_AFTER_SPACES = frozenset("=+-@\uff1d\uff0b\uff0d\uff20")
# Exports a minute per merchant: each reads every matching row (a limit on the work one key can start).
EXPORTS_PER_MINUTE = 6

# created_from / created_to: an ISO 8601 date (2026-11-22: 00:00 UTC) or date-time (2026-11-22T12:00, seconds and
# up to 6 decimals optional; Z or an offset +HH:MM/-HH:MM, none meaning UTC). The pattern is exactly what is read
# (the OpenAPI document gives it): real calendar days only, leap days included (years 0001-9999).
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_TIME = "T(?:[01][0-9]|2[0-3]):[0-5][0-9](?::[0-5][0-9](?:\\.[0-9]{1,6})?)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?"
TIME_BOUND_PATTERN = f"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)(?:{_TIME})?$"
_TIME_BOUND = re.compile(TIME_BOUND_PATTERN)
TIME_BOUND_MESSAGE = "must be an ISO 8601 date (2026-11-22) or date-time (2026-11-22T12:00:00Z)"


@dataclass(frozen=True)
class ExportFilters:
    """The list's filters (``status``: the effective status), and the creation-time range: from ``created_from``
    (inclusive) to ``created_to`` (exclusive), each timezone-aware; None: no bound."""

    status: str | None = None
    order_id: str | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None


def parse_time_bound(text: str) -> datetime:
    """A range bound (:data:`TIME_BOUND_PATTERN`) as a UTC datetime: a date is its 00:00 UTC, a date-time without
    an offset is UTC. ValueError (:data:`TIME_BOUND_MESSAGE`) for anything else."""
    if _TIME_BOUND.fullmatch(text) is None:
        raise ValueError(TIME_BOUND_MESSAGE)
    value = datetime.fromisoformat(text)  # reads every form the pattern allows
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:  # past datetime's range once in UTC (0001-01-01 with +HH:MM, 9999-12-31 with -HH:MM)
        return (datetime.min if value.year == 1 else datetime.max).replace(tzinfo=UTC)


def check_range(filters: ExportFilters) -> None:
    """400 VALIDATION_ERROR when ``created_from`` is after ``created_to`` (equal: an empty range, allowed)."""
    start, end = filters.created_from, filters.created_to
    if start is not None and end is not None and start > end:
        raise validation_error({"created_from": ["must not be after created_to"]})


def attachment_name(now: datetime) -> str:
    """The file name a download gets: ``intents-<UTC date>.csv``."""
    return f"intents-{now.astimezone(UTC):%Y-%m-%d}.csv"


def download(chunks: Iterator[str], now: datetime) -> Response:
    """``chunks`` streamed as the ``text/csv; charset=utf-8`` attachment ``intents-<UTC date>.csv``. The request's
    context (its database session included) stays usable while they are produced (``stream_with_context``)."""
    response = current_app.response_class(stream_with_context(chunks), mimetype=CSV)
    response.headers["Content-Disposition"] = f'attachment; filename="{attachment_name(now)}"'
    return response


def export_csv(merchant_id: str, filters: ExportFilters, now: datetime | None = None) -> Iterator[str]:
    """The merchant's intents matching ``filters`` as CSV text in chunks (the header row, then one chunk per
    batch), newest first. The range is checked, the merchant's EXPORTS_PER_MINUTE counted and the first batch read
    before this returns: a bad range (400), too many exports (429) or a database that cannot be reached (503) is
    answered before the first byte of the file is sent."""
    check_range(filters)
    enforce(f"export:{merchant_id}", EXPORTS_PER_MINUTE)
    now = now or clock.now()
    batches = _batches(merchant_id, filters, now)
    first = next(batches)
    return _chunks(itertools.chain([first], batches), now)


def _batches(merchant_id: str, filters: ExportFilters, now: datetime) -> Iterator[list[RowMapping]]:
    """The matching rows, newest first, a batch at a time (at least one batch, maybe empty)."""
    created_at, intent_id = _intents.c.created_at, _intents.c.id
    conditions = [_intents.c.merchant_id == merchant_id]  # as list_intents filters
    if filters.status is not None:
        conditions.append(_status_condition(filters.status, now))
    if filters.order_id is not None:
        conditions.append(_intents.c.order_id == filters.order_id)
    if filters.created_from is not None:
        conditions.append(created_at >= filters.created_from)
    if filters.created_to is not None:
        conditions.append(created_at < filters.created_to)
    size = BATCH_SIZE
    query = select(*_EXPORT_COLUMNS).where(*conditions).order_by(created_at.desc(), intent_id.desc()).limit(size)
    statement = query
    while True:
        rows = [row._mapping for row in db.session.execute(statement)]
        # End the read transaction: the connection goes back to the pool while the batch is sent (the session
        # starts a new transaction for the next one; the keyset below needs no snapshot kept between them).
        db.session.rollback()
        yield rows
        if len(rows) < size:
            return
        last_created, last_id = rows[-1]["created_at"], rows[-1]["id"]
        # After the last row in (created_at desc, id desc); the first term lets the index bound the scan.
        statement = query.where(created_at <= last_created, (created_at < last_created) | (intent_id < last_id))


def _chunks(batches: Iterable[list[RowMapping]], now: datetime) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)  # RFC 4180: CRLF line ends, quoted as needed
    writer.writerow(HEADER)
    yield _take(buffer)
    for rows in batches:
        if rows:
            writer.writerows(csv_row(row, now) for row in rows)
            yield _take(buffer)


def _take(buffer: io.StringIO) -> str:
    text = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    return text


def csv_row(row: Mapping[Any, Any], now: datetime) -> list[str]:
    """One intent's cells, in :data:`HEADER`'s order."""
    isoformat = clock.isoformat
    return [
        str(row["id"]),
        effective_status(row["status"], row["expires_at"], now, row["settlement_id"]),
        format(from_atomic(row["amount_atomic"]), "f"),
        text_cell(row["chain"]),
        text_cell(row["tx_hash"]),
        text_cell(row["buyer_address"]),
        isoformat(row["created_at"]) or "",
        isoformat(row["paid_at"]) or "",
        isoformat(row["expires_at"]) or "",
        text_cell(row["order_id"]),
        text_cell(row["description"]),
        text_cell(row["payment_link_id"]),
        text_cell(dumps(row["metadata"] or {})),
        format(from_atomic(row["refunded_atomic"] or 0), "f"),
    ]


def text_cell(value: str | None) -> str:
    """A text cell: empty for None; a leading ``'`` when a spreadsheet would read it as a formula (OWASP), or when
    it starts with ``'`` itself (so one leading ``'`` removed is always the stored value)."""
    if value is None:
        return ""
    stripped = value.lstrip()
    if value.startswith((*FORMULA_STARTS, "'")) or stripped[:1] in _FORMULA_AFTER_SPACES:
        return f"'{value}"
    return value
