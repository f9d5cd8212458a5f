"""An HTTP client for agents that pays HTTP 402 answers by itself, within spending caps.

    agent = PayingAgent(private_key, rpc_urls={"eip155:84532": "http://127.0.0.1:8545"},
                        max_per_call="0.10", max_per_session="1.00")
    response = agent.get("http://127.0.0.1:5000/report")   # pays on a 402, retries, returns the 200
    response.payment                                        # {"transaction", "network", "payer", ...}

On a 402 it reads the requirements (our ``X-Payment-Required`` header, else x402 v2's
``PAYMENT-REQUIRED`` header, else an x402 v1 JSON body), refuses with :class:`SpendLimitError`
before signing anything when the price is above ``max_per_call`` or would take the session past
``max_per_session``, picks a requirement on a network where the account holds enough USDC (read
through ``rpc_urls``; without them, the first EVM requirement), signs an EIP-3009 authorization
(fresh nonce, ``validBefore`` = now + 900 s, as the spec's agent flow asks) and sends
the request again with the payment in the header the server asked in. A 503 with ``Retry-After``
(settlement still running) is retried with the same payment, so it is never paid twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

import requests

from payintent import jsonlimits, x402
from payintent.client import choose_requirement
from payintent.eip3009 import DEFAULT_VALIDITY_SECONDS, sign_authorization

__all__ = ["PayingAgent", "PaymentRequiredError", "SpendLimitError"]

ATOMIC = Decimal(10) ** 6
SETTLING_RETRIES = 6


class PaymentRequiredError(Exception):
    """A 402 the agent cannot or will not pay (no usable requirement, or the server refused the payment)."""

    def __init__(self, message: str, response: requests.Response | None = None) -> None:
        super().__init__(message)
        self.response = response


class SpendLimitError(PaymentRequiredError):
    """Paying would exceed ``max_per_call`` or ``max_per_session``; nothing was signed."""


class PayingAgent:
    """A ``requests``-like client (``get``, ``post``, ``request``) that pays 402s with an EVM account."""

    def __init__(
        self,
        account: Any,
        *,
        rpc_urls: Mapping[str, str] | None = None,
        max_per_call: Decimal | str | int = "1",
        max_per_session: Decimal | str | int = "10",
        session: requests.Session | None = None,
        timeout: float = 90.0,
        balance_of: Callable[[str, str, str, str], int] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from eth_account import Account

        self.account = account if hasattr(account, "sign_message") else Account.from_key(account)
        self.rpc_urls = dict(rpc_urls or {})
        self.max_per_call = Decimal(str(max_per_call))
        self.max_per_session = Decimal(str(max_per_session))
        self.session = session or requests.Session()
        self.timeout = timeout
        self._balance_of = balance_of
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()
        self._spent_atomic = 0  # settled or possibly settled (a payment sent counts until proven unpaid)
        self.payments: list[dict[str, Any]] = []

    @property
    def spent_usdc(self) -> Decimal:
        return Decimal(self._spent_atomic) / ATOMIC

    def get(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("POST", url, **kwargs)

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        """Send; on a 402, pay once within the caps and send again. Returns the final response
        (``response.payment`` holds the decoded payment receipt, or None when nothing was paid)."""
        kwargs.setdefault("timeout", self.timeout)
        response = self.session.request(method, url, **kwargs)
        response.payment = None  # type: ignore[attr-defined]
        if response.status_code != 402:
            return response
        version, requirements, intent_id, v2_required = _challenge_of(response)
        requirement = self._choose(requirements, response)
        amount = int(requirement["maxAmountRequired"])
        self._reserve(amount, response)
        header_name, header_value = self._payment_header(version, requirement, intent_id, v2_required)
        headers = {**(kwargs.pop("headers", None) or {}), header_name: header_value}
        try:
            paid = self.session.request(method, url, headers=headers, **kwargs)
            for _ in range(SETTLING_RETRIES):  # still settling: same payment again, never a new one
                if paid.status_code != 503 or "Retry-After" not in paid.headers:
                    break
                self._sleep(float(paid.headers.get("Retry-After") or 1))
                paid = self.session.request(method, url, headers=headers, **kwargs)
        except requests.RequestException:
            raise  # the payment may have settled: it stays counted against the session cap
        if paid.status_code == 402:
            self._release(amount)  # refused: the authorization was not settled
            raise PaymentRequiredError(f"the server refused the payment: {_error_of(paid)}", paid)
        receipt_header = paid.headers.get(x402.PAYMENT_RESPONSE) or paid.headers.get(x402.V2_PAYMENT_RESPONSE)
        receipt = x402.decode_header(receipt_header) if receipt_header else None
        paid.payment = receipt  # type: ignore[attr-defined]
        if receipt is not None:
            self.payments.append({**receipt, "url": url, "amount_atomic": amount})
        return paid

    # --- steps -------------------------------------------------------------------------------------

    def _choose(self, requirements: list[dict[str, Any]], response: requests.Response) -> dict[str, Any]:
        evm = [
            r for r in requirements if str(r.get("network", "")).startswith("eip155:") and r.get("scheme") == "exact"
        ]
        if not evm:
            raise PaymentRequiredError("the 402 offers no EVM exact requirement this agent can pay", response)
        cheapest = min(int(r["maxAmountRequired"]) for r in evm)
        self._check_caps(cheapest, response)
        if not self.rpc_urls:
            return evm[0]
        options = {"balance_of": self._balance_of} if self._balance_of else {}
        return choose_requirement({"payment_requirements": evm}, self.account.address, self.rpc_urls, **options)

    def _check_caps(self, amount: int, response: requests.Response | None) -> None:
        price = Decimal(amount) / ATOMIC
        if price > self.max_per_call:
            raise SpendLimitError(f"the price {price} USDC is above max_per_call {self.max_per_call}", response)
        if Decimal(self._spent_atomic + amount) / ATOMIC > self.max_per_session:
            raise SpendLimitError(
                f"paying {price} USDC would take the session to {self.spent_usdc + price} USDC, above "
                f"max_per_session {self.max_per_session}",
                response,
            )

    def _reserve(self, amount: int, response: requests.Response) -> None:
        with self._lock:  # concurrent calls cannot together pass the session cap
            self._check_caps(amount, response)
            self._spent_atomic += amount

    def _release(self, amount: int) -> None:
        with self._lock:
            self._spent_atomic -= amount

    def _payment_header(
        self, version: int, requirement: dict[str, Any], intent_id: str | None, v2_required: dict[str, Any] | None
    ) -> tuple[str, str]:
        payload = sign_authorization(
            self.account, requirement, now=int(self._clock()), valid_for=DEFAULT_VALIDITY_SECONDS
        )
        if version == 2 and v2_required is not None:
            accepted = next(
                a for a in v2_required["accepts"] if x402.caip2_network(str(a["network"])) == requirement["network"]
            )
            body = {
                "x402Version": 2,
                "payload": _nested(payload),
                "accepted": accepted,
                "resource": v2_required.get("resource"),
            }
            return x402.V2_PAYMENT, x402.encode_header(body)
        body = {"x402Version": 1, "scheme": "exact", "network": requirement["network"], "payload": payload}
        if intent_id:
            body["intent_id"] = intent_id
        else:  # a plain x402 v1 server: its own network names and the spec's nested payload
            body["network"] = x402.v1_network(requirement["network"])
            body["payload"] = _nested(payload)
        return x402.PAYMENT, x402.encode_header(body)


def _nested(payload: Mapping[str, str]) -> dict[str, Any]:
    """Our flat EVM payload in the spec's nested form ``{authorization, signature}`` (the libraries' form)."""
    return {"authorization": {k: v for k, v in payload.items() if k != "signature"}, "signature": payload["signature"]}


def _challenge_of(response: requests.Response) -> tuple[int, list[dict[str, Any]], str | None, dict[str, Any] | None]:
    """(version, requirements in our shape, intent id, the v2 object) from a 402, in order of preference."""
    try:
        ours = response.headers.get(x402.PAYMENT_REQUIRED)
        if ours:
            decoded = x402.decode_header(ours)
            return 1, [dict(r) for r in decoded.get("accepts") or []], decoded.get("intent_id"), None
        v2 = response.headers.get(x402.V2_PAYMENT_REQUIRED)
        if v2:
            decoded = x402.decode_header(v2)
            return 2, [x402.from_v2_accepts(a) for a in decoded.get("accepts") or []], None, decoded
        body = jsonlimits.loads(response.content)  # depth-capped: a hostile server cannot crash us
        accepts = [{**a, "network": x402.caip2_network(str(a["network"]))} for a in body.get("accepts") or []]
        return 1, accepts, body.get("intent_id"), None
    except (x402.HeaderError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PaymentRequiredError(f"the 402 carries no readable payment requirements ({exc})", response) from None


def _error_of(response: requests.Response) -> str:
    try:
        body = jsonlimits.loads(response.content)  # depth-capped: a hostile server cannot crash us
    except ValueError:
        return response.text[:200]
    return str(body.get("error") or body)[:300] if isinstance(body, dict) else str(body)[:300]
