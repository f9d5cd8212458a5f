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
(fresh nonce, ``validBefore`` = now + the requirement's ``maxTimeoutSeconds``, at least 60 s and at
most 900 s) and sends the request again with the payment in the header the server asked in. It
signs only for the USDC contracts in ``allowed_assets`` (default :data:`KNOWN_USDC`, Circle's USDC
on the networks the service supports; pass the devnet's TestUSDC explicitly): any other asset
raises :class:`AssetNotAllowedError` before anything is signed. An amount that is not a positive
whole number of atomic units (``^[1-9][0-9]{0,30}$``) is refused the same way.

The session cap bounds what a hostile server can take: an authorization once sent stays counted in
``spent_usdc`` whatever the server answers (it may keep it and settle it later), until it can no
longer be settled: its ``validBefore`` has passed and the chain shows it unused (with an RPC URL
for its network), or, without one, a margin after ``validBefore`` on the agent's clock
(:meth:`PayingAgent.release_expired`, also run when the cap would refuse a payment).

After paying it never pays twice for one answer:

- the access token a payintent paywall returns (``X-Payment-Access``) is kept and presented again
  for the same URL until it expires, so those reads cost nothing;
- a 503 with ``Retry-After`` (settlement still running) is retried with the same payment, as is a
  429 with ``Retry-After`` (waits capped at 30 s);
- a payment to a payintent paywall (or any x402 v2 server) carries the x402 ``payment-identifier``
  extension, a random id of its own: when the connection breaks after the payment was sent, the agent
  sends the *same* payment again, and a server honouring the extension answers the first result (the
  money moved once); anywhere else the authorization settles at most once (its nonce is single-use).
"""

from __future__ import annotations

import email.utils
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC
from decimal import Decimal
from typing import Any

import requests

from payintent import jsonlimits, x402
from payintent.client import choose_requirement
from payintent.eip3009 import DEFAULT_VALIDITY_SECONDS, sign_authorization

__all__ = ["KNOWN_USDC", "AssetNotAllowedError", "PayingAgent", "PaymentRequiredError", "SpendLimitError"]

ATOMIC = Decimal(10) ** 6
SETTLING_RETRIES = 6
RECOVERY_ATTEMPTS = 6
MAX_RETRY_AFTER_SECONDS = 30  # a server asking for longer (or for nan, inf, a date years ahead) gets this
_AMOUNT = re.compile(r"^[1-9][0-9]{0,30}\Z")
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]{40}\Z")
AUTHORIZATION_STATE_ABI: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "authorizationState",
        "stateMutability": "view",
        "inputs": [{"name": "authorizer", "type": "address"}, {"name": "nonce", "type": "bytes32"}],
        "outputs": [{"name": "", "type": "bool"}],
    }
]

log = logging.getLogger(__name__)
# Circle's USDC contracts on the EVM networks the service supports (backend/chains/testnets.json).
KNOWN_USDC: dict[str, tuple[str, ...]] = {
    "eip155:84532": ("0x036CbD53842c5426634e7929541eC2318f3dCF7e",),  # Base Sepolia
    "eip155:11155111": ("0x1c7D4B196Cb0C7B01d743Fbc6116a902379C7238",),  # Ethereum Sepolia
    "eip155:5042002": ("0x3600000000000000000000000000000000000000",),  # Arc Testnet
}


class PaymentRequiredError(Exception):
    """A 402 the agent cannot or will not pay (no usable requirement, or the server refused the payment)."""

    def __init__(self, message: str, response: requests.Response | None = None) -> None:
        super().__init__(message)
        self.response = response


class SpendLimitError(PaymentRequiredError):
    """Paying would exceed ``max_per_call`` or ``max_per_session``; nothing was signed."""


class AssetNotAllowedError(PaymentRequiredError):
    """The 402 asks for a token contract not in ``allowed_assets``; nothing was signed."""


@dataclass(frozen=True)
class _Sent:
    """An authorization the agent sent: counted against the session cap until it can no longer settle."""

    amount: int
    network: str
    asset: str
    payer: str
    nonce: str
    valid_before: int


def _amount_of(requirement: Mapping[str, Any]) -> int | None:
    """A requirement's ``maxAmountRequired`` if it is a positive whole number of atomic units (<= 31 digits)."""
    value = requirement.get("maxAmountRequired")
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = str(value)
    return int(text) if _AMOUNT.match(text) else None


def _allowed(assets: Mapping[str, str | Iterable[str]]) -> dict[str, frozenset[str]]:
    return {
        network: frozenset(a.lower() for a in ([listed] if isinstance(listed, str) else listed))
        for network, listed in assets.items()
    }


class PayingAgent:
    """A ``requests``-like client (``get``, ``post``, ``request``) that pays 402s with an EVM account."""

    min_validity_seconds = 60  # validBefore is at least this far ahead (the API wants 30 s left to settle)
    expiry_margin_seconds = 60  # a sent authorization counts this long past validBefore (clocks, reorgs)

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
        allowed_assets: Mapping[str, str | Iterable[str]] | None = None,
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
        self.allowed_assets = _allowed(KNOWN_USDC if allowed_assets is None else allowed_assets)
        self._tokens: dict[tuple[str, str], tuple[str, float]] = {}  # (METHOD, url) -> (access token, expiry)
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()
        self._spent_atomic = 0  # settled or possibly settled (a payment sent counts until proven unpaid)
        self._open: list[_Sent] = []  # sent, not known settled: counted until they expire unused
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
        headers = dict(kwargs.pop("headers", None) or {})
        slot = (method.upper(), requests.Request(method, url, params=kwargs.get("params")).prepare().url or url)
        token = self._token(slot)
        response = self.session.request(
            method, url, headers={**headers, x402.PAYMENT_ACCESS: token} if token else headers, **kwargs
        )
        # requests.Response has no `payment`: this client documents it as an extra attribute of its answers.
        response.payment = None  # type: ignore[attr-defined]
        if response.status_code != 402:
            return response
        with self._lock:
            self._tokens.pop(slot, None)
        version, requirements, intent_id, v2_required, ours = _challenge_of(response)
        requirement = self._choose(requirements, response)
        amount = int(requirement["maxAmountRequired"])
        self._reserve(amount, response)
        try:
            header_name, header_value, payload = self._payment_header(
                version, requirement, intent_id, v2_required, ours
            )
        except Exception as exc:  # nothing was sent: the reservation goes back
            self._release(amount)
            raise PaymentRequiredError(f"cannot pay this 402's requirement: {exc}", response) from None
        sent = _Sent(amount, requirement["network"], str(requirement["asset"]), self.account.address,
                     str(payload["nonce"]), int(payload["validBefore"]))  # fmt: skip
        with self._lock:  # from here on, whatever the server says, it may hold the authorization
            self._open.append(sent)
        pay_headers = {**headers, header_name: header_value}
        try:
            paid, taken = self._send_payment(method, url, pay_headers, kwargs)
        except requests.RequestException:
            paid, taken = None, True  # the payment may have settled: it stays counted against the session cap
        if taken and (paid is None or paid.status_code == 402):  # paid, but the answer was lost
            paid = self._recover(method, url, pay_headers, kwargs)
        assert paid is not None  # None only with taken: then recovered above
        if paid.status_code == 402:  # still counted: a refusal is the server's word, not the chain's
            raise PaymentRequiredError(f"the server refused the payment: {_error_of(paid)}", paid)
        receipt_header = paid.headers.get(x402.PAYMENT_RESPONSE) or paid.headers.get(x402.V2_PAYMENT_RESPONSE)
        try:
            receipt = x402.decode_header(receipt_header) if receipt_header else None
        except x402.HeaderError:
            receipt = None
        paid.payment = receipt  # type: ignore[attr-defined]  # as above
        if receipt is not None:
            with self._lock:  # settled: spent for good
                if sent in self._open:
                    self._open.remove(sent)
            self.payments.append({**receipt, "url": url, "amount_atomic": amount})
        self._keep(slot, paid)
        return paid

    # --- after paying ------------------------------------------------------------------------------

    def _send_payment(
        self, method: str, url: str, pay_headers: dict[str, str], kwargs: dict[str, Any]
    ) -> tuple[requests.Response, bool]:
        """Send the payment; while settling (503) or busy (429) with ``Retry-After``, send the same payment again.
        Returns the last answer and whether the payment may have been taken (a 503 was seen)."""
        paid = self.session.request(method, url, headers=pay_headers, **kwargs)
        taken = False
        for _ in range(SETTLING_RETRIES):  # still settling, or busy: never a new payment
            if paid.status_code not in (429, 503) or "Retry-After" not in paid.headers:
                break
            taken = True
            self._sleep(_retry_after(paid.headers.get("Retry-After"), self._clock()))
            paid = self.session.request(method, url, headers=pay_headers, **kwargs)
        return paid, taken

    def _recover(self, method: str, url: str, pay_headers: dict[str, str], kwargs: dict[str, Any]) -> requests.Response:
        """Get what a payment whose answer was lost bought: the *same* payment again (its payment-identifier gets
        the first result from a server honouring it; elsewhere it settles at most once)."""
        error: requests.RequestException | None = None
        for _ in range(RECOVERY_ATTEMPTS):
            try:
                return self._send_payment(method, url, pay_headers, kwargs)[0]
            except requests.RequestException as exc:
                error = exc
                self._sleep(1)
        assert error is not None
        raise error

    def _token(self, slot: tuple[str, str]) -> str | None:
        held = self._tokens.get(slot)
        return held[0] if held and held[1] > self._clock() else None

    def _keep(self, slot: tuple[str, str], response: requests.Response) -> None:
        token = response.headers.get(x402.PAYMENT_ACCESS)
        try:
            expires = float(response.headers.get(x402.PAYMENT_ACCESS_EXPIRES) or 0)
        except ValueError:
            return
        if response.ok and token and expires > self._clock():
            now = self._clock()
            with self._lock:  # calls from several threads share the agent
                for stale in [k for k, (_, until) in self._tokens.items() if until <= now]:
                    self._tokens.pop(stale, None)
                self._tokens[slot] = (token, expires)

    # --- steps -------------------------------------------------------------------------------------

    def _choose(self, requirements: list[dict[str, Any]], response: requests.Response) -> dict[str, Any]:
        evm = [
            r for r in requirements if str(r.get("network", "")).startswith("eip155:") and r.get("scheme") == "exact"
        ]
        if not evm:
            raise PaymentRequiredError("the 402 offers no EVM exact requirement this agent can pay", response)
        evm = [r for r in evm if _amount_of(r) is not None and _ADDRESS.match(str(r.get("payTo", "")))]
        if not evm:
            raise PaymentRequiredError(
                "the 402's EVM requirements have no valid maxAmountRequired (a positive whole number of atomic "
                "units) and payTo (an address): nothing was signed",
                response,
            )
        allowed = [r for r in evm if str(r.get("asset", "")).lower() in self.allowed_assets.get(r["network"], ())]
        if not allowed:
            offered = ", ".join(f"{r.get('asset')} on {r['network']}" for r in evm)
            raise AssetNotAllowedError(
                f"the 402 asks for {offered}: not an allowed USDC contract (allowed_assets= to pay another)", response
            )
        evm = allowed
        cheapest = min(int(r["maxAmountRequired"]) for r in evm)
        self._within_caps(cheapest, response, reserve=False)
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
        self._within_caps(amount, response, reserve=True)

    def _within_caps(self, amount: int, response: requests.Response, *, reserve: bool) -> None:
        """Check the caps (and reserve ``amount``); when the session cap refuses, first stop counting
        the authorizations that can no longer settle."""
        for attempt in range(2):
            try:
                with self._lock:  # concurrent calls cannot together pass the session cap
                    self._check_caps(amount, response)
                    if reserve:
                        self._spent_atomic += amount
                return
            except SpendLimitError:
                if attempt or not self.release_expired():
                    raise

    def release_expired(self) -> Decimal:
        """Stop counting sent authorizations that can no longer be settled; returns how much (USDC).

        One is released once its ``validBefore`` has passed on the agent's clock and, with an RPC URL
        for its network, the chain's newest block is ``expiry_margin_seconds`` past ``validBefore`` with
        the authorization unused; without one, once the agent's clock is that margin past it. One the
        chain shows used stays counted for good."""
        now = self._clock()
        with self._lock:
            due = [sent for sent in self._open if sent.valid_before <= now]
        released = 0
        for sent in due:
            verdict = self._unusable(sent, now)
            with self._lock:
                if verdict is None or sent not in self._open:
                    continue
                self._open.remove(sent)
                if verdict:
                    self._spent_atomic -= sent.amount
                    released += sent.amount
        return Decimal(released) / ATOMIC

    def _unusable(self, sent: _Sent, now: float) -> bool | None:
        """True: it can never settle; False: it did (spent); None: not known yet."""
        rpc_url = self.rpc_urls.get(sent.network)
        deadline = sent.valid_before + self.expiry_margin_seconds
        if not rpc_url:
            return True if now > deadline else None
        try:
            from web3 import Web3

            w3 = Web3(Web3.HTTPProvider(rpc_url, request_kwargs={"timeout": 10}, exception_retry_configuration=None))
            block = w3.eth.get_block("latest")
            token = w3.eth.contract(address=Web3.to_checksum_address(sent.asset), abi=AUTHORIZATION_STATE_ABI)
            used = token.functions.authorizationState(
                Web3.to_checksum_address(sent.payer), bytes.fromhex(sent.nonce.removeprefix("0x"))
            ).call(block_identifier=block["number"])
        except Exception as exc:  # an unreachable chain decides nothing: it stays counted
            log.warning("cannot read authorization %s on %s: %s", sent.nonce, sent.network, exc)
            return None
        if used:
            return False
        return True if int(block["timestamp"]) > deadline else None

    def _release(self, amount: int) -> None:
        with self._lock:
            self._spent_atomic -= amount

    def _validity(self, requirement: Mapping[str, Any]) -> int:
        """How long the authorization is valid: the requirement's maxTimeoutSeconds, within the floor and 900 s."""
        timeout = requirement.get("maxTimeoutSeconds")
        text = str(timeout) if isinstance(timeout, int | str) and not isinstance(timeout, bool) else ""
        seconds = int(text) if text.isdigit() and len(text) < 8 else DEFAULT_VALIDITY_SECONDS
        return max(self.min_validity_seconds, min(seconds, DEFAULT_VALIDITY_SECONDS))

    def _payment_header(
        self,
        version: int,
        requirement: dict[str, Any],
        intent_id: str | None,
        v2_required: dict[str, Any] | None,
        ours: bool,
    ) -> tuple[str, str, dict[str, Any]]:
        """(header name, value, the signed payload). A payintent paywall's (``ours``) and a v2 server's payment
        carries a payment-identifier (a plain v1 server may refuse fields it does not know)."""
        payload = sign_authorization(
            self.account, requirement, now=int(self._clock()), valid_for=self._validity(requirement)
        )
        if version == 2 and v2_required is not None:
            accepted = next(a for a in v2_required["accepts"] if _same_requirement(a, requirement))
            body = {
                "x402Version": 2,
                "payload": _nested(payload),
                "accepted": accepted,
                "resource": v2_required.get("resource"),
                "extensions": _payment_identifier(),
            }
            return x402.V2_PAYMENT, x402.encode_header(body), payload
        body = {"x402Version": 1, "scheme": "exact", "network": requirement["network"], "payload": payload}
        if intent_id:
            body["intent_id"] = intent_id
        if ours:
            body["extensions"] = _payment_identifier()
        elif not intent_id:  # a plain x402 v1 server: its own network names and the spec's nested payload
            body["network"] = x402.v1_network(requirement["network"])
            body["payload"] = _nested(payload)
        return x402.PAYMENT, x402.encode_header(body), payload


def _same_requirement(entry: Mapping[str, Any], requirement: Mapping[str, Any]) -> bool:
    """Whether a v2 ``accepts`` entry is the requirement the agent signed (network, asset, payTo, amount)."""
    try:
        mapped = x402.from_v2_accepts(entry)
    except (KeyError, TypeError, AttributeError):
        return False
    return (
        mapped.get("network") == requirement.get("network")
        and str(mapped.get("asset", "")).lower() == str(requirement.get("asset", "")).lower()
        and str(mapped.get("payTo", "")).lower() == str(requirement.get("payTo", "")).lower()
        and mapped.get("maxAmountRequired") == str(requirement.get("maxAmountRequired"))
    )


def _retry_after(value: str | None, now: float) -> float:
    """Seconds to wait from a ``Retry-After`` (seconds or an HTTP date), within 0..MAX_RETRY_AFTER_SECONDS;
    1 for anything unreadable (nan, inf, garbage)."""
    text = (value or "").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
            seconds = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp() - now
        except (TypeError, ValueError, IndexError, OverflowError):
            return 1.0
    if not math.isfinite(seconds):
        return 1.0
    return min(max(seconds, 0.0), float(MAX_RETRY_AFTER_SECONDS))


def _nested(payload: Mapping[str, str]) -> dict[str, Any]:
    """Our flat EVM payload in the spec's nested form ``{authorization, signature}`` (the libraries' form)."""
    return {"authorization": {k: v for k, v in payload.items() if k != "signature"}, "signature": payload["signature"]}


def _payment_identifier() -> dict[str, Any]:
    """The x402 ``payment-identifier`` extension with a fresh random id (one per payment)."""
    return {"payment-identifier": {"info": {"id": f"pay_{secrets.token_urlsafe(24)}"}}}


def _challenge_of(
    response: requests.Response,
) -> tuple[int, list[dict[str, Any]], str | None, dict[str, Any] | None, bool]:
    """(version, requirements in our shape, intent id, the v2 object, whether the 402 is a payintent paywall's)
    from a 402, in order of preference."""
    try:
        ours = response.headers.get(x402.PAYMENT_REQUIRED)
        if ours:
            decoded = x402.decode_header(ours)
            intent_id = decoded.get("intent_id")
            return 1, [dict(r) for r in decoded.get("accepts") or []], intent_id, None, True
        v2 = response.headers.get(x402.V2_PAYMENT_REQUIRED)
        if v2:
            decoded = x402.decode_header(v2)
            return 2, [x402.from_v2_accepts(a) for a in decoded.get("accepts") or []], None, decoded, False
        body = jsonlimits.loads(response.content)  # depth-capped: a hostile server cannot crash us
        accepts = [{**a, "network": x402.caip2_network(str(a["network"]))} for a in body.get("accepts") or []]
        return 1, accepts, body.get("intent_id"), None, False
    except (x402.HeaderError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PaymentRequiredError(f"the 402 carries no readable payment requirements ({exc})", response) from None


def _error_of(response: requests.Response) -> str:
    try:
        body = jsonlimits.loads(response.content)  # depth-capped: a hostile server cannot crash us
    except ValueError:
        return response.text[:200]
    return str(body.get("error") or body)[:300] if isinstance(body, dict) else str(body)[:300]
