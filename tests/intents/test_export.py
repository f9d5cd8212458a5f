"""CSV export of a merchant's intents: the API's GET /x402/intents/export.csv and the dashboard's download."""

from __future__ import annotations

import csv
import io
import json
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
import requests
from sqlalchemy import update

from backend import clock as clock_module
from backend.extensions import db
from backend.intents import export
from backend.intents.models import Intent
from tests.dashboard.helpers import log_in
from tests.intents.helpers import URL, create, mark_paid
from tests.payintent.conftest import serve

EXPORT = f"{URL}/export.csv"
HEADER = [
    "intent_id", "status", "amount_usdc", "chain", "tx_hash", "buyer_address", "created_at", "paid_at",
    "expires_at", "order_id", "description", "payment_link_id", "metadata", "refunded_usdc",
]  # fmt: skip


def parse(body: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(body, newline="")))


def download(client: Any, merchant: Any, query: str = "") -> list[dict[str, str]]:
    """The export's rows (the header checked), as dicts."""
    response = client.get(f"{EXPORT}{query}", headers=merchant.headers)
    assert response.status_code == 200, response.data
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    table = parse(response.get_data(as_text=True))
    assert table[0] == HEADER
    return [dict(zip(HEADER, row, strict=True)) for row in table[1:]]


def ids(rows: list[dict[str, str]]) -> list[str]:
    return [row["intent_id"] for row in rows]


def at(clock: Any, text: str) -> None:
    clock.current = datetime.fromisoformat(text)


# --- the file --------------------------------------------------------------------------------------


def test_header_then_one_row_per_intent_with_exact_values(client, merchant, clock):
    pending = create(client, merchant, amount_usdc=12.5, order_id="order-1", description="Two mugs")
    clock.advance(seconds=1)
    paid = create(client, merchant, amount_usdc=7)
    clock.advance(seconds=90)
    mark_paid(paid["intent_id"])  # paid_at: now
    tiny = create(client, merchant, amount_usdc=0.000001)
    large = create(client, merchant, amount_usdc=1000000)  # same created_at as tiny: the id orders them

    response = client.get(EXPORT, headers=merchant.headers)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    assert response.headers["Content-Disposition"] == 'attachment; filename="intents-2026-11-22.csv"'
    assert response.headers["Cache-Control"] == "no-store"
    body = response.get_data(as_text=True)
    assert body.startswith(",".join(HEADER) + "\r\n") and body.endswith("\r\n")  # RFC 4180 line ends
    rows = [dict(zip(HEADER, row, strict=True)) for row in parse(body)[1:]]

    same_time = sorted([tiny["intent_id"], large["intent_id"]], reverse=True)
    assert ids(rows) == [*same_time, paid["intent_id"], pending["intent_id"]]  # newest first, then id desc
    by_id = {row["intent_id"]: row for row in rows}
    assert by_id[pending["intent_id"]] == {
        "intent_id": pending["intent_id"],
        "status": "pending",
        "amount_usdc": "12.5",
        "chain": "",
        "tx_hash": "",
        "buyer_address": "",
        "created_at": "2026-11-22T12:00:00.000Z",
        "paid_at": "",
        "expires_at": "2026-11-22T12:30:00.000Z",
        "order_id": "order-1",
        "description": "Two mugs",
        "payment_link_id": "",
        "metadata": "{}",
        "refunded_usdc": "0",
    }
    assert by_id[paid["intent_id"]] == {
        "intent_id": paid["intent_id"],
        "status": "paid",
        "amount_usdc": "7",
        "chain": "eip155:84532",
        "tx_hash": "0x" + "ab" * 32,
        "buyer_address": "0x" + "11" * 20,
        "created_at": "2026-11-22T12:00:01.000Z",
        "paid_at": "2026-11-22T12:01:31.000Z",
        "expires_at": "2026-11-22T12:30:01.000Z",
        "order_id": "",
        "description": "",
        "payment_link_id": "",
        "metadata": "{}",
        "refunded_usdc": "0",
    }
    assert by_id[tiny["intent_id"]]["amount_usdc"] == "0.000001"  # a plain decimal, never 1E-6
    assert by_id[large["intent_id"]]["amount_usdc"] == "1000000"  # never 1E+6


def test_an_empty_export_is_the_header_alone(client, merchant):
    response = client.get(EXPORT, headers=merchant.headers)
    assert response.status_code == 200
    assert response.get_data(as_text=True) == ",".join(HEADER) + "\r\n"


def test_the_route_is_not_taken_for_an_intent_id(client, merchant):
    """/export.csv is its own rule (werkzeug prefers the static one), and real ids still reach the item."""
    intent = create(client, merchant)
    response = client.get(EXPORT, headers=merchant.headers)
    assert response.status_code == 200 and response.mimetype == "text/csv"
    assert parse(response.get_data(as_text=True))[1][0] == intent["intent_id"]
    item = client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers)
    assert item.status_code == 200 and item.get_json()["data"]["intent_id"] == intent["intent_id"]
    # The export has GET only, and the item's rule never takes "export.csv" for an id: no DELETE (a cancel) there,
    # and OPTIONS and 405 list the export's methods alone.
    refused = client.delete(EXPORT, headers=merchant.headers)
    assert refused.status_code == 405 and refused.get_json()["error"]["code"] == "METHOD_NOT_ALLOWED"
    assert refused.headers["Allow"] == "GET, HEAD, OPTIONS"
    assert set(client.options(EXPORT).headers["Allow"].split(", ")) == {"GET", "HEAD", "OPTIONS"}
    assert set(client.options(f"{URL}/{intent['intent_id']}").headers["Allow"].split(", ")) == {
        "GET",
        "HEAD",
        "OPTIONS",
        "DELETE",
    }
    assert client.get(f"{URL}/export.csvx", headers=merchant.headers).get_json()["error"]["code"] == "NOT_FOUND"


def test_metadata_is_compact_json(client, merchant):
    created = create(client, merchant, metadata={"customer": "c_42", "n": 1.25, "ok": True, "none": None, "q": 'a "b"'})
    (row,) = download(client, merchant)
    assert row["intent_id"] == created["intent_id"]
    assert json.loads(row["metadata"]) == {"customer": "c_42", "n": 1.25, "ok": True, "none": None, "q": 'a "b"'}
    assert ", " not in row["metadata"] and ": " not in row["metadata"]  # compact separators
    assert "1.25" in row["metadata"]  # the number as sent, not through a float


# --- filters -------------------------------------------------------------------------------------


def test_filters_by_status_and_order_id(client, merchant, clock):
    pending = create(client, merchant, order_id="o-1")["intent_id"]
    clock.advance(seconds=1)
    paid = create(client, merchant, order_id="o-2")["intent_id"]
    mark_paid(paid)
    clock.advance(seconds=1)
    cancelled = create(client, merchant, order_id="o-1")["intent_id"]
    assert client.delete(f"{URL}/{cancelled}", headers=merchant.headers).status_code == 200
    clock.advance(seconds=1)
    overdue = create(client, merchant, order_id="o-3")["intent_id"]
    clock.advance(minutes=30)  # overdue is expired now (the sweep has not run: as the list says)
    fresh = create(client, merchant, order_id="o-1")["intent_id"]

    assert ids(download(client, merchant, "?status=paid")) == [paid]
    assert ids(download(client, merchant, "?status=cancelled")) == [cancelled]
    # pending, overdue: both created before the 30 minutes passed; pending (12:00:00) is overdue too.
    assert ids(download(client, merchant, "?status=expired")) == [overdue, pending]
    assert [r["status"] for r in download(client, merchant, "?status=expired")] == ["expired", "expired"]
    assert ids(download(client, merchant, "?status=pending")) == [fresh]
    assert ids(download(client, merchant, "?order_id=o-1")) == [fresh, cancelled, pending]
    assert ids(download(client, merchant, "?order_id=o-1&status=cancelled")) == [cancelled]
    assert download(client, merchant, "?order_id=nope") == []


def test_filters_by_creation_time(client, merchant, clock):
    made = {}
    for name, when in [
        ("late-21st", "2026-11-21T23:59:59.999999+00:00"),
        ("midnight", "2026-11-22T00:00:00+00:00"),
        ("noon", "2026-11-22T12:00:00+00:00"),
        ("next-day", "2026-11-23T00:00:00+00:00"),
    ]:
        at(clock, when)
        made[name] = create(client, merchant)["intent_id"]

    def names(query: str) -> list[str]:
        by_id = {intent_id: name for name, intent_id in made.items()}
        return [by_id[i] for i in ids(download(client, merchant, query))]

    # A date is its 00:00 UTC; created_from is inclusive, created_to exclusive.
    assert names("?created_from=2026-11-22") == ["next-day", "noon", "midnight"]
    assert names("?created_to=2026-11-22") == ["late-21st"]
    assert names("?created_from=2026-11-22&created_to=2026-11-23") == ["noon", "midnight"]
    assert names("?created_from=2026-11-22&created_to=2026-11-22") == []  # an empty range
    # Date-times: Z, an offset (%2B is +), none (UTC), fractions to the microsecond.
    assert names("?created_from=2026-11-22T12:00:00Z") == ["next-day", "noon"]
    assert names("?created_from=2026-11-22T13:00%2B01:00") == ["next-day", "noon"]
    assert names("?created_to=2026-11-22T07:00-05:00") == ["midnight", "late-21st"]
    assert names("?created_to=2026-11-22T12:00") == ["midnight", "late-21st"]
    assert names("?created_from=2026-11-22T00:00:00.000001Z") == ["next-day", "noon"]
    assert names("?created_from=2026-11-21T23:59:59.999999Z&created_to=2026-11-22T00:00:00.000001Z") == [
        "midnight",
        "late-21st",
    ]
    # The ends of the calendar, where the offset takes the time past datetime's range in UTC.
    assert len(names("?created_from=0001-01-01T00:00%2B01:00&created_to=9999-12-31T23:59-01:00")) == 4
    assert names("?created_to=2024-02-29") == []  # a leap day
    assert names("?created_from=2026-11-22&status=pending&order_id=nope") == []  # with the list's filters


def test_a_range_that_ends_before_it_starts_is_400(client, merchant):
    response = client.get(f"{EXPORT}?created_from=2026-11-23&created_to=2026-11-22T23:59Z", headers=merchant.headers)
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["code"] == "VALIDATION_ERROR"
    assert error["fields"] == {"created_from": ["must not be after created_to"]}


@pytest.mark.parametrize(
    "query",
    [
        "created_from=2026-02-30",  # no such day
        "created_from=2025-02-29",  # not a leap year
        "created_from=1900-02-29",  # nor is a century not divisible by 400
        "created_to=22/11/2026",
        "created_to=2026-11-22T24:00",
        "created_to=2026-11-22 12:00",
        "created_to=2026-11-22T12:00:00.1234567Z",
        "created_to=2026-11-22T12:00%2B24:00",
        "created_to=0000-01-01",
        "created_to=2026-11-22%0A",
        "created_to=",
        "status=bogus",
        "order_id=",
        "limit=10",  # no paging: the export is every matching intent
        "offset=0",
        "unknown=1",
    ],
)
def test_bad_query_is_400_naming_the_parameter(client, merchant, query):
    response = client.get(f"{EXPORT}?{query}", headers=merchant.headers)
    assert response.status_code == 400, response.data
    error = response.get_json()["error"]
    assert error["code"] == "VALIDATION_ERROR"
    assert list(error["fields"]) == [query.split("=")[0]]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-22", datetime(2026, 11, 22, tzinfo=UTC)),
        ("2024-02-29", datetime(2024, 2, 29, tzinfo=UTC)),
        ("2000-02-29T23:59", datetime(2000, 2, 29, 23, 59, tzinfo=UTC)),
        ("2026-11-22T12:30:15.5Z", datetime(2026, 11, 22, 12, 30, 15, 500000, tzinfo=UTC)),
        ("2026-11-22T00:30:00.000001+01:00", datetime(2026, 11, 21, 23, 30, 0, 1, tzinfo=UTC)),
        ("0001-01-01T00:00+00:01", datetime.min.replace(tzinfo=UTC)),  # before the first instant: clamped
        ("9999-12-31T23:59-00:01", datetime.max.replace(tzinfo=UTC)),  # after the last one
    ],
)
def test_time_bounds_are_read_as_utc(text, expected):
    value = export.parse_time_bound(text)
    assert value == expected and value.utcoffset() is not None and value.utcoffset().total_seconds() == 0


# --- tenancy and authentication ------------------------------------------------------------------


def test_another_merchants_intents_never_appear(client, merchant, other_merchant):
    mine = create(client, merchant, order_id="shared")["intent_id"]
    theirs = create(client, other_merchant, order_id="shared")["intent_id"]
    mark_paid(theirs)
    assert ids(download(client, merchant)) == [mine]
    assert ids(download(client, merchant, "?order_id=shared")) == [mine]
    assert download(client, merchant, "?status=paid") == []
    assert ids(download(client, other_merchant)) == [theirs]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk_test_nope"}, {"Authorization": "Basic x"}])
def test_without_a_valid_key_it_is_401(client, merchant, headers):
    create(client, merchant)
    response = client.get(EXPORT, headers=headers)
    assert response.status_code == 401
    assert response.get_json()["error"]["code"] == "UNAUTHORIZED"
    assert merchant.api_key not in response.get_data(as_text=True)


# --- CSV injection -------------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["=", "+", "-", "@", "\t", "\r"])
def test_a_cell_that_would_be_a_formula_gets_a_quote(client, merchant, first):
    value = f'{first}HYPERLINK("http://evil.example","x")'
    created = create(client, merchant, order_id=value, description=value, metadata={"k": value})
    db.session.execute(
        update(Intent)
        .where(Intent.id == created["intent_id"])
        .values(
            status="paid",
            tx_hash=value,
            buyer_address=value,
            chain=value,
            payment_link_id=value,
            paid_at=clock_module.now(),
        )
    )
    db.session.commit()
    (row,) = download(client, merchant)
    for column in ("order_id", "description", "tx_hash", "buyer_address", "chain", "payment_link_id"):
        assert row[column] == "'" + value, column
    assert json.loads(row["metadata"]) == {"k": value}  # starts with {: no formula


def test_text_cells():
    for first in export.FORMULA_STARTS:
        assert export.text_cell(f"{first}1") == f"'{first}1"
    # Spaces before a trigger, full-width triggers, and a leading ' (so one ' removed is always the stored value).
    for risky in (" =x", "\n=x", "\u3000+1", "\uff1d1+1", "\uff20SUM(A1)", "'=already", "'plain"):
        assert export.text_cell(risky) == "'" + risky, risky
    for safe in ("1+1", "a=b", "order-1", "Mugs = 2", ""):
        assert export.text_cell(safe) == safe
    assert export.text_cell(None) == ""


def test_exports_are_limited_per_merchant(client, merchant, other_merchant, monkeypatch):
    monkeypatch.setattr(export, "EXPORTS_PER_MINUTE", 2)
    codes = []
    for _ in range(3):
        answer = client.get(EXPORT, headers=merchant.headers)
        answer.close()
        codes.append(answer.status_code)
    assert codes == [200, 200, 429]
    other = client.get(EXPORT, headers=other_merchant.headers)
    other.close()
    assert other.status_code == 200  # each merchant its own count


def test_commas_quotes_and_line_breaks_survive(client, merchant):
    description = 'Mugs, "large"\r\nand a\nlid'
    create(client, merchant, description=description, order_id="a,b")
    (row,) = download(client, merchant)
    assert row["description"] == description and row["order_id"] == "a,b"


# --- streaming -----------------------------------------------------------------------------------


def test_more_than_one_batch_is_streamed_in_order(client, merchant, clock, monkeypatch):
    monkeypatch.setattr(export, "BATCH_SIZE", 2)
    created = []
    for n in range(7):  # pairs created at the same instant: the keyset goes on by id within one created_at
        created.append((clock.current, create(client, merchant, order_id=f"o-{n}")["intent_id"]))
        if n % 2:
            clock.advance(seconds=1)
    newest_first = [intent_id for _, intent_id in sorted(created, reverse=True)]

    response = client.get(EXPORT, headers=merchant.headers, buffered=False)
    assert response.status_code == 200
    chunks = [chunk.decode() for chunk in response.response]
    response.close()
    assert len(chunks) == 5  # the header, then batches of 2, 2, 2 and 1
    assert [len(parse(chunk)) for chunk in chunks] == [1, 2, 2, 2, 1]
    assert ids([dict(zip(HEADER, row, strict=True)) for row in parse("".join(chunks))[1:]]) == newest_first
    # A multiple of the batch size: the last (empty) batch sends nothing.
    assert ids(download(client, merchant, "?order_id=o-0")) == [created[0][1]]
    monkeypatch.setattr(export, "BATCH_SIZE", 1)
    assert len(download(client, merchant)) == 7


def test_streaming_over_http_reads_every_batch_in_the_request(app, client, merchant, clock, monkeypatch):
    """Served for real (its own app context per request, gone once the view returns but for
    stream_with_context): the batches after the first are read while the body is sent."""
    monkeypatch.setattr(export, "BATCH_SIZE", 2)
    made = []
    for _ in range(5):
        made.append(create(client, merchant)["intent_id"])
        clock.advance(seconds=1)
    with (
        contextmanager(serve)(app) as base_url,
        requests.get(f"{base_url}{EXPORT}", headers=merchant.headers, stream=True, timeout=30) as response,
    ):
        assert response.status_code == 200
        assert response.headers["Content-Disposition"] == 'attachment; filename="intents-2026-11-22.csv"'
        assert "Content-Length" not in response.headers  # streamed
        body = b"".join(response.iter_content(chunk_size=None)).decode()
    rows = [dict(zip(HEADER, row, strict=True)) for row in parse(body)[1:]]
    assert ids(rows) == made[::-1]


# --- the dashboard -------------------------------------------------------------------------------


def test_the_dashboard_downloads_the_intents_pages_filters(client, merchant, clock):
    pending = create(client, merchant, order_id="o-1", amount_usdc=3.5)["intent_id"]
    clock.advance(seconds=1)
    paid = create(client, merchant, order_id="o-1")["intent_id"]
    mark_paid(paid)
    create(client, merchant, order_id="o-2")
    assert log_in(client, "shop@example.com").status_code == 302

    page = client.get("/dashboard/intents?status=pending&order_id=o-1").get_data(as_text=True)
    assert 'href="/dashboard/intents/export.csv?status=pending&amp;order_id=o-1">Export CSV</a>' in page
    unfiltered = client.get("/dashboard/intents?page=1").get_data(as_text=True)
    assert 'href="/dashboard/intents/export.csv">Export CSV</a>' in unfiltered

    response = client.get("/dashboard/intents/export.csv?status=pending&order_id=o-1&page=7")  # page: ignored
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    assert response.headers["Content-Disposition"] == 'attachment; filename="intents-2026-11-22.csv"'
    table = parse(response.get_data(as_text=True))
    assert table[0] == HEADER
    assert [(row[0], row[1], row[2]) for row in table[1:]] == [(pending, "pending", "3.5")]
    everything = parse(client.get("/dashboard/intents/export.csv").get_data(as_text=True))
    assert len(everything) == 4

    bad = client.get("/dashboard/intents/export.csv?status=bogus")
    assert bad.status_code == 400
    assert "Choose a status from the list." in bad.get_data(as_text=True)


def test_the_dashboard_download_needs_a_log_in(client, merchant, other_merchant):
    create(client, merchant, order_id="mine")
    response = client.get("/dashboard/intents/export.csv?status=pending")
    assert response.status_code == 302
    assert response.headers["Location"].startswith("/dashboard/login?next=")
    assert "export.csv" in response.headers["Location"]
    # Another merchant logged in sees only its own.
    assert log_in(client, "other@example.com").status_code == 302
    table = parse(client.get("/dashboard/intents/export.csv").get_data(as_text=True))
    assert table == [HEADER]
