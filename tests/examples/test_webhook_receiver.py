"""examples/webhook_receiver.py as a real process: verify, 401 on bad signatures, dedupe by id, fulfil once."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from payintent.webhooks import new_secret, service_signature, signature_headers

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "webhook_receiver.py"
STARTUP_TIMEOUT = 30.0


@dataclass
class RunningReceiver:
    proc: subprocess.Popen[str]
    secret: str
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    url: str = ""

    def next_line(self, timeout: float = 5.0) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line on the receiver's stdout within {timeout}s") from None
        assert line is not None, "the receiver exited"
        return line

    def stop(self) -> list[str]:
        """Stop the receiver; the stdout lines not read yet."""
        self.proc.terminate()
        self.proc.wait(timeout=10)
        rest = []
        while (line := self.lines.get(timeout=10)) is not None:  # the reader thread ends with None at EOF
            rest.append(line)
        return rest


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[RunningReceiver]:
    secret = new_secret()
    log = tmp_path / "receiver.stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--port", "0"],
            env={**os.environ, "WEBHOOK_SECRET": secret},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    running = RunningReceiver(proc, secret)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            running.lines.put(line.rstrip("\n"))
        running.lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        running.url = running.next_line(timeout=STARTUP_TIMEOUT)
        assert running.url.startswith("http://127.0.0.1:"), running.url
        yield running
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        reader.join(timeout=10)  # it reads to EOF, then the pipe can be closed under it
        if proc.stdout is not None:
            proc.stdout.close()
        print(log.read_text())  # the receiver's log, shown by pytest when a test fails


def envelope(event: str = "payment.completed", **data: Any) -> tuple[str, bytes]:
    event_id = "evt_" + uuid.uuid4().hex
    body = {"id": event_id, "event": event, "created_at": "2026-01-01T00:00:00Z", "data": data}
    return event_id, json.dumps(body, separators=(",", ":")).encode()


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url + "webhooks", data=body, headers={"Content-Type": "application/json", **headers}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def test_a_signed_event_is_fulfilled_once_and_its_duplicates_are_acknowledged(receiver: RunningReceiver) -> None:
    intent_id = str(uuid.uuid4())
    event_id, body = envelope(intent_id=intent_id, amount_usdc=25.00, status="paid")
    headers = signature_headers(receiver.secret, event_id, body, int(time.time()))

    assert post(receiver.url, body, headers) == (200, {"received": True})
    assert json.loads(receiver.next_line()) == {"id": event_id, "event": "payment.completed", "intent_id": intent_id}

    # A retry of the same delivery (same bytes, same id) and a replay (a newer timestamp): acknowledged, not redone.
    assert post(receiver.url, body, headers) == (200, {"duplicate": True})
    replay = signature_headers(receiver.secret, event_id, body, int(time.time()) + 1)
    assert post(receiver.url, body, replay) == (200, {"duplicate": True})

    # Another event without an intent (only the Service-Signature header) is fulfilled too.
    other_id, other = envelope("invoice.paid", invoice_id="inv_1")
    assert post(receiver.url, other, {"Service-Signature": service_signature(receiver.secret, other)})[0] == 200
    assert json.loads(receiver.next_line()) == {"id": other_id, "event": "invoice.paid", "intent_id": None}

    assert receiver.stop() == []  # nothing more was fulfilled


def test_bad_signatures_are_refused_without_processing(receiver: RunningReceiver) -> None:
    event_id, body = envelope(intent_id=str(uuid.uuid4()))
    now = int(time.time())
    good = signature_headers(receiver.secret, event_id, body, now)
    refused = {
        "another secret": signature_headers(new_secret(), event_id, body, now),
        "no signature": {},
        "no Service-Signature": {k: v for k, v in good.items() if k != "Service-Signature"},
        "hex without sha256=": {**good, "Service-Signature": good["Service-Signature"].removeprefix("sha256=")},
        "bad Standard signature": {
            **good,
            "webhook-signature": signature_headers(new_secret(), event_id, body, now)["webhook-signature"],
        },
        "incomplete Standard headers": {**good, "webhook-timestamp": ""},
        "stale timestamp": signature_headers(receiver.secret, event_id, body, now - 301),
    }
    for case, headers in refused.items():
        assert post(receiver.url, body, headers) == (401, {"error": "invalid signature"}), case
    tampered = body.replace(b'"payment.completed"', b'"payment.failed"')
    assert post(receiver.url, tampered, good)[0] == 401
    reserialised = json.dumps(json.loads(body)).encode()
    assert reserialised != body
    assert post(receiver.url, reserialised, good)[0] == 401

    # The refused attempts did not mark the id as seen: the authentic delivery is still fulfilled.
    assert post(receiver.url, body, good) == (200, {"received": True})
    assert json.loads(receiver.next_line())["id"] == event_id
    assert receiver.stop() == []


@pytest.mark.parametrize("secret", [None, "", "whsec_", "not-a-whsec-secret"])
def test_the_receiver_does_not_start_without_a_secret(tmp_path: Path, secret: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WEBHOOK_SECRET"}
    if secret is not None:
        env["WEBHOOK_SECRET"] = secret
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--port", "0"], env=env, capture_output=True, text=True, timeout=STARTUP_TIMEOUT
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "WEBHOOK_SECRET" in result.stderr
