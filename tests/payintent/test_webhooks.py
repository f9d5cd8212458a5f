"""The client package's webhook helpers: signing, verification, and interop with the reference library."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from datetime import UTC, datetime

import pytest
from standardwebhooks import Webhook
from standardwebhooks import WebhookVerificationError as StandardVerificationError

from payintent.webhooks import (
    WebhookVerificationError,
    new_secret,
    service_signature,
    signature_headers,
    standard_signature,
    verify_signature,
    verify_standard,
)

# A fixed secret (whsec_ + base64 of 32 bytes) so the expected HMACs below are reproducible.
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
EVENT_ID = "evt_01J9ZQ3W4X5Y6Z7A8B9C0D1E2F"
STAMP = 1_700_000_000
ENVELOPE = {
    "id": EVENT_ID,
    "event": "payment.completed",
    "created_at": "2024-11-14T22:13:20Z",
    "data": {"intent_id": "6f1c1f5e-2b1a-4c8e-9d7e-0a1b2c3d4e5f", "amount_usdc": "25.00", "note": "café ☕"},
}
# Compact, as the service serialises it, and with non-ASCII bytes in it.
BODY = json.dumps(ENVELOPE, separators=(",", ":"), ensure_ascii=False).encode()


def test_service_signature_is_the_hex_hmac_of_the_raw_body_keyed_with_the_whole_secret() -> None:
    independent = hmac.new(SECRET.encode("utf-8"), BODY, hashlib.sha256).hexdigest()
    assert service_signature(SECRET, BODY) == f"sha256={independent}"
    verify_signature(BODY, f"sha256={independent}", SECRET)  # no exception: authentic
    verify_signature(bytearray(BODY), f"sha256={independent}", SECRET)


def test_standard_signature_is_the_base64_hmac_of_id_timestamp_body_keyed_with_the_decoded_secret() -> None:
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    assert len(key) == 32
    digest = hmac.new(key, f"{EVENT_ID}.{STAMP}.".encode() + BODY, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(digest).decode()
    assert standard_signature(SECRET, EVENT_ID, STAMP, BODY) == expected
    assert signature_headers(SECRET, EVENT_ID, BODY, STAMP) == {
        "Service-Signature": service_signature(SECRET, BODY),
        "webhook-id": EVENT_ID,
        "webhook-timestamp": str(STAMP),
        "webhook-signature": expected,
    }


def test_a_tampered_body_is_refused() -> None:
    header = service_signature(SECRET, BODY)
    tampered = BODY.replace(b'"25.00"', b'"26.00"')
    assert tampered != BODY
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_signature(tampered, header, SECRET)
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_signature(BODY + b"\n", header, SECRET)
    headers = signature_headers(SECRET, EVENT_ID, BODY, STAMP)
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_standard(tampered, headers, SECRET, now=STAMP)


def test_a_re_serialised_body_is_refused() -> None:
    # The same envelope, parsed and dumped again: equal as JSON, different as bytes.
    reserialised = json.dumps(json.loads(BODY)).encode()
    assert json.loads(reserialised) == json.loads(BODY)
    assert reserialised != BODY
    headers = signature_headers(SECRET, EVENT_ID, BODY, STAMP)
    with pytest.raises(WebhookVerificationError):
        verify_signature(reserialised, headers["Service-Signature"], SECRET)
    with pytest.raises(WebhookVerificationError):
        verify_standard(reserialised, headers, SECRET, now=STAMP)


def test_a_signature_made_with_another_secret_is_refused() -> None:
    other = new_secret()
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_signature(BODY, service_signature(other, BODY), SECRET)
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_standard(BODY, signature_headers(other, EVENT_ID, BODY, STAMP), SECRET, now=STAMP)


@pytest.mark.parametrize("header", [None, ""])
def test_a_missing_service_signature_is_refused(header: str | None) -> None:
    with pytest.raises(WebhookVerificationError, match="missing or malformed"):
        verify_signature(BODY, header, SECRET)


def test_a_service_signature_without_the_sha256_prefix_is_refused() -> None:
    hex_only = hmac.new(SECRET.encode(), BODY, hashlib.sha256).hexdigest()
    for header in (hex_only, f"sha1={hex_only}", f"SHA256={hex_only}", f"v1,{hex_only}"):
        with pytest.raises(WebhookVerificationError, match="missing or malformed"):
            verify_signature(BODY, header, SECRET)
    # The prefix alone is not enough either.
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_signature(BODY, "sha256=", SECRET)


def test_verify_signature_refuses_text_bodies() -> None:
    header = service_signature(SECRET, BODY)
    with pytest.raises(TypeError, match="raw body bytes"):
        verify_signature(BODY.decode(), header, SECRET)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        verify_signature(json.loads(BODY), header, SECRET)  # type: ignore[arg-type]


@pytest.mark.parametrize("offset", [0, 1, -1, 299, -299, 300, -300])
def test_verify_standard_accepts_timestamps_within_five_minutes(offset: int) -> None:
    headers = signature_headers(SECRET, EVENT_ID, BODY, STAMP)
    assert verify_standard(BODY, headers, SECRET, now=STAMP + offset) == EVENT_ID
    assert verify_standard(BODY, headers, SECRET, tolerance=300, now=STAMP + offset + 0.0) == EVENT_ID


@pytest.mark.parametrize("offset", [301, -301, 300.5, 3600, -86_400])
def test_verify_standard_refuses_timestamps_more_than_five_minutes_away(offset: float) -> None:
    headers = signature_headers(SECRET, EVENT_ID, BODY, STAMP)  # correctly signed, only too old or too new
    with pytest.raises(WebhookVerificationError, match="tolerance"):
        verify_standard(BODY, headers, SECRET, now=STAMP + offset)


def test_verify_standard_uses_the_clock_when_no_now_is_given() -> None:
    fresh = int(time.time())
    assert verify_standard(BODY, signature_headers(SECRET, EVENT_ID, BODY, fresh), SECRET) == EVENT_ID
    with pytest.raises(WebhookVerificationError, match="tolerance"):
        verify_standard(BODY, signature_headers(SECRET, EVENT_ID, BODY, fresh - 600), SECRET)


def test_verify_standard_accepts_one_right_signature_among_several() -> None:
    headers = signature_headers(SECRET, EVENT_ID, BODY, STAMP)
    right = headers["webhook-signature"]
    wrong = standard_signature(new_secret(), EVENT_ID, STAMP, BODY)
    for value in (f"{wrong} {right}", f"{right} {wrong}", f"v2,abc {wrong} {right}"):
        assert verify_standard(BODY, {**headers, "webhook-signature": value}, SECRET, now=STAMP) == EVENT_ID
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_standard(BODY, {**headers, "webhook-signature": f"{wrong} v1,AAAA"}, SECRET, now=STAMP)


def test_verify_standard_reads_headers_case_insensitively_and_binds_the_id_and_timestamp() -> None:
    headers = signature_headers(SECRET, EVENT_ID, BODY, STAMP)
    as_sent = {"Webhook-Id": headers["webhook-id"], "WEBHOOK-TIMESTAMP": headers["webhook-timestamp"]}
    as_sent["Webhook-Signature"] = headers["webhook-signature"]
    assert verify_standard(BODY, as_sent, SECRET, now=STAMP) == EVENT_ID
    # The id and the timestamp are signed: changing either breaks the signature.
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_standard(BODY, {**headers, "webhook-id": "evt_other"}, SECRET, now=STAMP)
    with pytest.raises(WebhookVerificationError, match="mismatch"):
        verify_standard(BODY, {**headers, "webhook-timestamp": str(STAMP + 1)}, SECRET, now=STAMP)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_verify_standard_refuses_missing_headers(missing: str) -> None:
    headers = signature_headers(SECRET, EVENT_ID, BODY, STAMP)
    del headers[missing]
    with pytest.raises(WebhookVerificationError, match="missing"):
        verify_standard(BODY, headers, SECRET, now=STAMP)


def test_verify_standard_refuses_a_malformed_timestamp() -> None:
    headers = signature_headers(SECRET, EVENT_ID, BODY, STAMP)
    with pytest.raises(WebhookVerificationError, match="malformed"):
        verify_standard(BODY, {**headers, "webhook-timestamp": "yesterday"}, SECRET, now=STAMP)


def test_our_headers_verify_with_the_standardwebhooks_library() -> None:
    headers = signature_headers(SECRET, EVENT_ID, BODY, int(time.time()))  # the library checks its own clock
    assert Webhook(SECRET).verify(BODY, headers) == ENVELOPE
    with pytest.raises(StandardVerificationError):
        Webhook(new_secret()).verify(BODY, headers)
    with pytest.raises(StandardVerificationError):
        Webhook(SECRET).verify(BODY.replace(b"25.00", b"26.00"), headers)


def test_a_standardwebhooks_signature_verifies_with_ours() -> None:
    signed_at = datetime.fromtimestamp(STAMP, UTC)
    signature = Webhook(SECRET).sign(EVENT_ID, signed_at, BODY.decode("utf-8"))
    headers = {"webhook-id": EVENT_ID, "webhook-timestamp": str(STAMP), "webhook-signature": signature}
    assert signature == standard_signature(SECRET, EVENT_ID, STAMP, BODY)
    assert verify_standard(BODY, headers, SECRET, now=STAMP + 10) == EVENT_ID
    with pytest.raises(WebhookVerificationError):
        verify_standard(BODY, headers, new_secret(), now=STAMP + 10)


def test_new_secret_is_whsec_and_base64_of_32_random_bytes() -> None:
    first, second = new_secret(), new_secret()
    for secret in (first, second):
        assert secret.startswith("whsec_")
        raw = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
        assert len(raw) == 32
        assert "whsec_" + base64.b64encode(raw).decode() == secret  # canonical, padded standard base64
    assert first != second
    # A fresh secret signs and verifies both ways.
    verify_signature(BODY, service_signature(first, BODY), first)
    assert verify_standard(BODY, signature_headers(first, EVENT_ID, BODY, STAMP), first, now=STAMP) == EVENT_ID


@pytest.mark.parametrize("secret", ["", "   ", "whsec_"])
def test_an_empty_secret_is_a_setup_error_not_a_pass(secret):
    from payintent.webhooks import WebhookSecretError

    body = b'{"id":"evt_1"}'
    with pytest.raises(WebhookSecretError):
        verify_signature(body, "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest(), secret)
    with pytest.raises(WebhookSecretError):
        verify_standard(body, {"webhook-id": "evt_1", "webhook-timestamp": "1", "webhook-signature": "v1,x"}, secret,
                        now=1)  # fmt: skip


def test_standard_needs_raw_bytes_and_a_plain_timestamp():
    secret = new_secret()
    body = b'{"id":"evt_1"}'
    headers = signature_headers(secret, "evt_1", body, 1_700_000_000)
    with pytest.raises(TypeError):
        verify_standard(body.decode(), headers, secret, now=1_700_000_000)  # type: ignore[arg-type]
    for spelling in (" +1700000000 ", "1_700_000_000", "\u0661\u0667" + "\u0660" * 8):
        with pytest.raises(WebhookVerificationError):
            verify_standard(body, {**headers, "webhook-timestamp": spelling}, secret, now=1_700_000_000)
    padded = " " + headers["Service-Signature"] + " "
    verify_signature(body, padded, secret)  # surrounding spaces in a header value are not the signature
