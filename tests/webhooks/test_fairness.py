"""One merchant cannot stall webhook delivery for everyone (issue 14, Medium 6).

A "slow" merchant has several endpoints whose servers accept connections and never answer, and one whose
host name's DNS never answers, and feeds them many test events (cheap: one API call each). Another
merchant's event must still arrive within a few seconds, through the real worker dispatcher threads and
real HTTP servers. The DNS that never answers is the one part that cannot run here (it would need a name
server on port 53): ``socket.getaddrinfo`` is replaced for host names under ``.hang.test`` only, by one that
blocks until the test ends, as a real lookup to a silent name server does (it cannot be cancelled).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from sqlalchemy import func, select

from backend import clock
from backend.extensions import db
from backend.webhooks import services
from backend.webhooks.models import WebhookDelivery
from backend.webhooks.tasks import Dispatcher
from tests.webhooks.helpers import HUNG_SUFFIX, register, send_test


class HoldServer:
    """Accepts TCP connections, reads the request and never answers (until closed)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self._conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        with self._lock:
            for conn in self._conns:
                conn.close()


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.02)


def _in_flight(merchant_id: str) -> int:
    """Live leases of the merchant's deliveries (attempts being sent now), as any worker sees them."""
    db.session.rollback()  # a fresh snapshot
    return db.session.scalar(
        select(func.count())
        .select_from(WebhookDelivery)
        .where(
            WebhookDelivery.merchant_id == merchant_id,
            WebhookDelivery.status == "pending",
            WebhookDelivery.lease_expires_at > clock.now(),
        )
    )


def test_a_slow_merchant_does_not_delay_another_merchants_payment_completed(
    app, client, merchant, other_merchant, receiver, hung_dns
):
    assert app.config["PAYINTENT_SETTINGS"].webhook_timeout_seconds == 10.0  # the real deadline
    hold = HoldServer()
    slow_endpoints = [register(client, merchant, hold.url(f"/never/{n}"))["webhook_id"] for n in range(4)]
    slow_endpoints.append(register(client, merchant, f"http://never-answers{HUNG_SUFFIX}/hook")["webhook_id"])
    for _ in range(6):
        for webhook_id in slow_endpoints:
            send_test(client, merchant, webhook_id)
    fast = register(client, other_merchant, receiver.url("/ok"))

    dispatcher = Dispatcher(app, 4).start()  # what `payintent worker` runs (WEBHOOK_CONCURRENCY=4)
    peak = 0
    try:
        for _ in range(4):
            dispatcher.poke()  # what the RQ wake-up job does in a worker
        _wait(lambda: hold.accepted >= 1 and _in_flight(merchant.id) >= 2, 15, "the slow merchant is being served")

        sent_at = time.monotonic()
        queued = send_test(client, other_merchant, fast["webhook_id"], "payment.completed")
        dispatcher.poke()
        while not receiver.requests and time.monotonic() - sent_at < 15:
            peak = max(peak, _in_flight(merchant.id))
            time.sleep(0.02)
        waited = time.monotonic() - sent_at
        assert receiver.requests, "the other merchant's payment.completed was not delivered within 15 s"
        assert receiver.requests[0].headers["webhook-id"] == queued["event_id"]
        assert waited < 3.0, f"the other merchant's event waited {waited:.1f} s behind the slow merchant"
        peak = max(peak, _in_flight(merchant.id))
        settings = app.config["PAYINTENT_SETTINGS"]
        assert peak <= settings.webhook_max_in_flight_per_merchant < 4  # never every sender
        assert hold.accepted <= settings.webhook_max_in_flight_per_merchant
    finally:
        hold.close()  # the held attempts fail at once instead of at their deadline
        dispatcher.stop()


def test_the_merchant_cap_holds_when_senders_claim_at_the_same_instant(app, client, merchant, other_merchant, receiver):
    """Eight senders (of several workers) claim at once: each merchant still gets at most its cap. On
    PostgreSQL the claims run concurrently (READ COMMITTED, SKIP LOCKED), so counting live leases in the
    claim's own snapshot is not enough; on SQLite they queue for the write lock."""
    for shop in (merchant, other_merchant):
        for n in range(3):
            webhook_id = register(client, shop, receiver.url(f"/ok/{n}"))["webhook_id"]
            for _ in range(3):
                send_test(client, shop, webhook_id)
    db.session.commit()
    senders = 8
    barrier = threading.Barrier(senders)
    claimed: list[str] = []
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            with app.app_context():
                barrier.wait(timeout=10)
                got = services.claim_due(clock.now())
                if got is not None:
                    claimed.append(got.id)
                db.session.remove()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sender) for _ in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    db.session.rollback()
    owners = db.session.execute(
        select(WebhookDelivery.merchant_id, func.count())
        .where(WebhookDelivery.id.in_(claimed))
        .group_by(WebhookDelivery.merchant_id)
    ).all()
    cap = services.DEFAULT_MAX_IN_FLIGHT_PER_MERCHANT
    assert {merchant_id: n for merchant_id, n in owners} == {merchant.id: cap, other_merchant.id: cap}
