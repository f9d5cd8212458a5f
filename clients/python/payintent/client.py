"""A Python client for the payintent API, for merchants and for agents that pay.

Merchants create, read, list and cancel intents; an agent holding a private key pays one with
:meth:`PayIntentClient.pay`, which follows the spec's agent flow:

1. pick the payment requirement of a network on which the paying account holds enough USDC
   (read on chain at run time through RPC URLs the caller supplies; no chain id is hardcoded);
2. sign an EIP-3009 ``TransferWithAuthorization`` with a fresh random 32-byte nonce and
   ``validBefore`` = now + 900 s (:func:`payintent.eip3009.sign_authorization`);
3. post it to ``/api/v1/x402/pay`` and return the settlement (``tx_hash`` ...);
4. after a network error or a 5xx answer, read the intent before trying again: it may already be
   paid. While it is still pending it is polled (3 s apart, a bounded number of times) before a
   fresh authorization is signed and sent. A 4xx answer is raised, except ``ALREADY_PAID``, for
   which the paid intent's data is returned.

Amounts are sent as exact JSON numbers (``Decimal``, never a float) and come back as ``Decimal``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import requests
import simplejson

from payintent.eip3009 import DEFAULT_VALIDITY_SECONDS, evm_chain_id, sign_authorization
from payintent.jsonlimits import exceeds_depth

__all__ = ["NoFundedNetworkError", "PayIntentClient", "PayIntentError", "choose_requirement", "usdc_balance"]

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
USER_AGENT = "payintent-python/0.1"
# What a read of a paid intent carries, renamed to the shape of the /pay answer.
_PAID_FIELDS = {
    "tx_hash": "tx_hash",
    "settled_at": "paid_at",
    "amount_usdc": "amount_usdc",
    "network": "chain",
    "intent_id": "intent_id",
    "buyer_address": "buyer_address",
}
# 4xx answers from /pay that mean "someone's settlement is in flight": treated like a 5xx.
_IN_FLIGHT_CODES = frozenset({"PAYMENT_IN_PROGRESS"})
# The one function of the token the client calls (ERC-20 balanceOf).
BALANCE_OF_ABI: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "balanceOf",
        "stateMutability": "view",
        "inputs": [{"name": "account", "type": "address"}],
        "outputs": [{"name": "", "type": "uint256"}],
    }
]


class PayIntentError(Exception):
    """The API refused a call (``status`` is its HTTP status), or the client could not complete it.

    ``status`` is ``None`` when no HTTP answer was received (``code`` ``NETWORK_ERROR``) or the
    client itself refused (for example ``NO_FUNDED_NETWORK``). ``body`` is the decoded answer.
    """

    def __init__(self, status: int | None, code: str, message: str, body: Any = None) -> None:
        super().__init__(f"{code}: {message}" if status is None else f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body

    @property
    def transient(self) -> bool:
        """No answer, or a 5xx: the outcome of the call is unknown and it may be retried."""
        return self.code == "NETWORK_ERROR" if self.status is None else self.status >= 500


class NoFundedNetworkError(PayIntentError):
    """No network of the intent has an RPC URL at hand and enough of the account's USDC on it."""

    def __init__(self, message: str, balances: dict[str, int | str]) -> None:
        super().__init__(None, "NO_FUNDED_NETWORK", message, {"balances": balances})
        self.balances = balances


def usdc_balance(rpc_url: str, network: str, asset: str, owner: str, *, timeout: float = 10.0) -> int:
    """``asset.balanceOf(owner)`` on ``network`` in atomic units, read through ``rpc_url``.

    Checks that the RPC endpoint serves the chain the network names, so a mixed-up URL can never
    make a payment look funded.
    """
    from web3 import Web3  # imported here: a second to import, and only pay() needs it

    w3 = Web3(Web3.HTTPProvider(rpc_url, request_kwargs={"timeout": timeout}, exception_retry_configuration=None))
    served = int(w3.eth.chain_id)
    if served != evm_chain_id(network):
        raise ValueError(f"{rpc_url} serves chain id {served}, not {network}")
    token = w3.eth.contract(address=Web3.to_checksum_address(asset), abi=BALANCE_OF_ABI)
    return int(token.functions.balanceOf(Web3.to_checksum_address(owner)).call())


def choose_requirement(
    intent: Mapping[str, Any],
    owner: str,
    rpc_urls: Mapping[str, str],
    *,
    balance_of: Callable[[str, str, str, str], int] = usdc_balance,
) -> dict[str, Any]:
    """The first EVM ``exact`` requirement of the intent whose network has an RPC URL in
    ``rpc_urls`` and on which ``owner`` holds at least ``maxAmountRequired`` of its ``asset``."""
    balances: dict[str, int | str] = {}
    for requirement in intent.get("payment_requirements") or []:
        network = str(requirement.get("network", ""))
        if not network.startswith("eip155:") or requirement.get("scheme", "exact") != "exact":
            continue
        rpc_url = rpc_urls.get(network)
        if not rpc_url:
            balances[network] = "no RPC URL given"
            continue
        try:
            balance = balance_of(rpc_url, network, requirement["asset"], owner)
        except Exception as exc:  # one unreachable or misconfigured chain must not hide the others
            log.warning("cannot read the USDC balance of %s on %s: %s", owner, network, exc)
            balances[network] = f"unreadable: {exc}"
            continue
        balances[network] = balance
        if balance >= int(requirement["maxAmountRequired"]):
            return dict(requirement)
    needed = {r.get("network"): r.get("maxAmountRequired") for r in intent.get("payment_requirements") or []}
    raise NoFundedNetworkError(
        f"{owner} holds enough USDC on none of the intent's networks "
        f"(needed in atomic units: {needed}; found: {balances})",
        balances,
    )


def paid_result(intent: Mapping[str, Any]) -> dict[str, Any]:
    """A paid intent as the ``/pay`` success data: tx_hash, settled_at, amount_usdc, network, ..."""
    return {key: intent.get(field) for key, field in _PAID_FIELDS.items()}


def _exact_amount(amount: Decimal | str | int) -> Decimal:
    if isinstance(amount, bool) or not isinstance(amount, Decimal | str | int):
        raise TypeError("amount_usdc must be a Decimal, str or int (never a float: it is not exact)")
    value = Decimal(amount)
    if not value.is_finite():
        raise ValueError(f"amount_usdc must be a finite number, not {amount!r}")
    return value


class PayIntentClient:
    """The payintent REST API: ``PayIntentClient("http://127.0.0.1:8000", "sk_test_...")``.

    ``rpc_urls`` maps networks (``eip155:<chain id>``) to RPC URLs used by :meth:`pay` to find
    the account's USDC; ``sleep`` and ``clock`` are injectable for tests.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        pay_timeout: float = 90.0,
        session: requests.Session | None = None,
        rpc_urls: Mapping[str, str] | None = None,
        poll_interval: float = 3.0,
        poll_attempts: int = 5,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        base = base_url.rstrip("/")
        self.base_url = base.removesuffix(API_PREFIX)
        self.timeout = timeout
        self.pay_timeout = pay_timeout  # /pay waits for the chain (the server answers 504 after ~30 s)
        self.rpc_urls = dict(rpc_urls or {})
        self.poll_interval = poll_interval
        self.poll_attempts = poll_attempts
        self._sleep = sleep
        self._clock = clock
        self.api_key = api_key  # the paywall derives its token secret from it (payintent.access)
        self._owns_session = session is None
        self.session = session or requests.Session()
        self.session.headers.update(
            {"Authorization": f"Bearer {api_key}", "Accept": "application/json", "User-Agent": USER_AGENT}
        )

    # --- plumbing --------------------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_session:
            self.session.close()

    def __enter__(self) -> PayIntentClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One API call: the envelope's ``data`` (an object on every endpoint), or :class:`PayIntentError`."""
        response, decoded = self._send(method, path, body=body, params=params, headers=headers, timeout=timeout)
        data = decoded.get("data") if isinstance(decoded, dict) and decoded.get("success") is True else None
        if isinstance(data, dict) and response.ok:
            return data
        raise _refusal(method, path, response, decoded)

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> tuple[requests.Response, Any]:
        """One HTTP exchange: the answer and its decoded JSON (None when it is not JSON)."""
        sent_headers = dict(headers or {})
        data = None
        if body is not None:
            data = simplejson.dumps(body, use_decimal=True).encode()
            sent_headers["Content-Type"] = "application/json"
        try:
            response = self.session.request(
                method,
                f"{self.base_url}{API_PREFIX}{path}",
                data=data,
                params=params,
                headers=sent_headers,
                timeout=timeout or self.timeout,
            )
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise PayIntentError(None, "NETWORK_ERROR", f"{method} {path}: {exc}") from exc
        try:  # a hostile server's answer nested 20,000 deep is refused before parsing: no crash, an error below
            decoded = None if exceeds_depth(response.content) else simplejson.loads(response.text, use_decimal=True)
        except ValueError:
            decoded = None
        return response, decoded

    # --- intents ---------------------------------------------------------------------------------

    def create_intent(
        self, amount_usdc: Decimal | str | int, *, idempotency_key: str | None = None, **fields: Any
    ) -> dict[str, Any]:
        """Create an intent (``order_id``, ``description``, ``metadata``, ``redirect_url``,
        ``cancel_url`` as keyword fields; ``None`` ones are left out). ``idempotency_key`` makes a
        retry with the same fields return the first answer."""
        body = {"amount_usdc": _exact_amount(amount_usdc), **{k: v for k, v in fields.items() if v is not None}}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
        return self._request("POST", "/x402/intents", body=body, headers=headers)

    def get_intent(self, intent_id: str) -> dict[str, Any]:
        return self._request("GET", f"/x402/intents/{quote(str(intent_id), safe='')}")

    def list_intents(
        self,
        *,
        status: str | None = None,
        order_id: str | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> dict[str, Any]:
        """One page, newest first: ``{intents, total, limit, offset}``."""
        params = {"status": status, "order_id": order_id, "limit": limit, "offset": offset}
        return self._request("GET", "/x402/intents", params={k: v for k, v in params.items() if v is not None})

    def cancel_intent(self, intent_id: str) -> dict[str, Any]:
        """Cancel a pending intent: ``{intent_id, status: "cancelled"}``."""
        return self._request("DELETE", f"/x402/intents/{quote(str(intent_id), safe='')}")

    # --- paying ----------------------------------------------------------------------------------

    def pay(
        self,
        intent_or_id: Mapping[str, Any] | str,
        account: Any,
        rpc_urls: Mapping[str, str] | None = None,
        max_attempts: int = 3,
        max_rent_lamports: int | None = None,
    ) -> dict[str, Any]:
        """Pay an intent with ``account`` (an eth-account ``LocalAccount`` or a private key, or a solders
        ``Keypair`` for Solana).

        Returns the settlement: ``{tx_hash, settled_at, amount_usdc, network, intent_id,
        buyer_address}``. If the intent turns out to be paid already (``ALREADY_PAID``, or a read
        after a failed call), that payment's data is returned: compare ``buyer_address`` if it
        matters who paid. ``rpc_urls`` (default: the client's) names the networks the account may
        pay on. ``max_attempts`` bounds the ``/pay`` calls (each with a fresh nonce).

        Solana: a payment to a merchant whose USDC account does not exist opens it, and the payer
        pays its rent (about 0.00204 SOL) besides the USDC. The settlement a Solana payment returns
        says ``payer_pays_lamports`` (0, or that rent); ``max_rent_lamports`` caps it: a payment
        that would cost the payer more is not signed (``PayIntentError`` ``RENT_ABOVE_LIMIT``;
        ``0``: never pay a merchant's rent). None: no cap.
        """
        from eth_account import Account

        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        solana_signer = _solana_keypair(account)
        signer = solana_signer or (account if hasattr(account, "sign_message") else Account.from_key(account))
        if isinstance(intent_or_id, str) or not intent_or_id.get("payment_requirements"):
            intent_id = intent_or_id if isinstance(intent_or_id, str) else str(intent_or_id["intent_id"])
            intent: Mapping[str, Any] = self.get_intent(intent_id)
        else:
            intent = intent_or_id
        intent_id = str(intent["intent_id"])
        if intent.get("status") == "paid":
            return paid_result(intent)
        if intent.get("status") in ("cancelled", "expired"):
            raise _not_payable(intent)
        urls = self.rpc_urls if rpc_urls is None else rpc_urls
        if solana_signer is not None:
            requirement = next(
                (r for r in intent.get("payment_requirements") or [] if str(r["network"]).startswith("solana:")), None
            )
            if requirement is None:
                raise NoFundedNetworkError("the intent has no Solana requirement", {})
        else:
            requirement = choose_requirement(intent, signer.address, urls)
        last_error: PayIntentError | None = None
        for attempt in range(1, max_attempts + 1):
            if last_error is not None:
                outcome = self._await_outcome(intent_id)
                if outcome is None:  # never managed to read the intent: do not pay blind
                    raise last_error
                if outcome.get("status") == "paid":
                    return paid_result(outcome)
                log.info("intent %s still pending after %s; paying again (attempt %d)", intent_id, last_error, attempt)
            rent: int | None = None
            if solana_signer is not None:
                payload, rent = self._sign_solana(intent_id, requirement, solana_signer, max_rent_lamports)
            else:
                payload = sign_authorization(
                    signer, requirement, now=int(self._clock()), valid_for=DEFAULT_VALIDITY_SECONDS
                )
            signature = {"scheme": "exact", "network": requirement["network"], "x402Version": 1, "payload": payload}
            try:
                settled = self.settle(intent_id, signature)
                return settled if rent is None else {**settled, "payer_pays_lamports": rent}
            except PayIntentError as err:
                if err.code == "ALREADY_PAID":
                    return paid_result(self.get_intent(intent_id))
                if not (err.transient or err.code in _IN_FLIGHT_CODES):
                    raise
                log.warning("paying intent %s: %s; reading it before any retry", intent_id, err)
                last_error = err
        assert last_error is not None
        outcome = self._await_outcome(intent_id)
        if outcome is not None and outcome.get("status") == "paid":
            return paid_result(outcome)
        raise last_error

    def settle(self, intent_id: str, payment_signature: Mapping[str, Any]) -> dict[str, Any]:
        """One ``POST /x402/pay`` of a signed payment, as is (no retry): the settlement, or
        :class:`PayIntentError` (``ALREADY_PAID``, ``SETTLEMENT_PENDING``, ...)."""
        body = {"intent_id": intent_id, "payment_signature": dict(payment_signature)}
        return self._request("POST", "/x402/pay", body=body, timeout=self.pay_timeout)

    # --- refunds (the merchant's payout wallet pays the buyer back; the service relays) ---------------

    def create_refund(
        self, intent_id: str, amount_usdc: Decimal | str | int | None = None, *, reason: str | None = None
    ) -> dict[str, Any]:
        """Refund a paid intent: ``amount_usdc`` (default: all that is left to refund). The answer is the refund in
        ``requires_signature``, with the one requirement its ``pay_from`` wallet signs (:meth:`pay_refund`)."""
        body: dict[str, Any] = {}
        if amount_usdc is not None:
            body["amount_usdc"] = _exact_amount(amount_usdc)
        if reason is not None:
            body["reason"] = reason
        return self._request("POST", f"/x402/intents/{quote(str(intent_id), safe='')}/refunds", body=body)

    def get_refund(self, refund_id: str) -> dict[str, Any]:
        return self._request("GET", f"/refunds/{quote(str(refund_id), safe='')}")

    def pay_refund(self, refund: Mapping[str, Any], wallet: Any) -> dict[str, Any]:
        """Sign the refund's requirement with the merchant's payout ``wallet`` (an eth-account account or key, or a
        solders ``Keypair`` for Solana) and send it: the refund, ``succeeded`` with its ``tx_hash`` once it
        executed (``processing`` if the chain took longer than the service waits). Sent once, no retry: a refund
        is paid once (``REFUND_NOT_PAYABLE`` after that)."""
        (requirement,) = refund["payment_requirements"]
        refund_id = quote(str(refund["refund_id"]), safe="")
        if requirement["network"].startswith("solana:"):
            from payintent import solana_tx

            built = self._request("POST", f"/refunds/{refund_id}/solana-transaction")
            signed = solana_tx.sign_as(solana_tx.decode(built["transaction"]), wallet)
            fee_payer = str((requirement.get("extra") or {}).get("feePayer") or built["fee_payer"])
            # Sign only what the refund says: exactly its amount, to the buyer, the relay paying the fee only.
            solana_tx.check_payment(signed, dict(requirement), str(refund["refund_id"]), fee_payer)
            payload: dict[str, Any] = {"transaction": solana_tx.encode(signed)}
        else:
            payload = sign_authorization(
                wallet, requirement, now=int(self._clock()), valid_for=DEFAULT_VALIDITY_SECONDS
            )
        signature = {"scheme": "exact", "network": requirement["network"], "x402Version": 1, "payload": payload}
        return self._request(
            "POST", f"/refunds/{refund_id}/pay", body={"payment_signature": signature}, timeout=self.pay_timeout
        )

    # --- the x402 facilitator API (what resource servers call: our paywall, the official middlewares) ----------

    def facilitator_supported(self) -> dict[str, Any]:
        """``GET /x402/facilitator/supported``: the kinds (network, x402 version) this merchant is paid with; each
        kind's ``extra`` holds the requirement's fields that do not depend on the resource (``payTo``, ``asset``)."""
        return self._facilitator("GET", "/supported")

    def facilitator_verify(
        self, payment_payload: Mapping[str, Any], payment_requirements: Mapping[str, Any]
    ) -> dict[str, Any]:
        """``POST /x402/facilitator/verify``: the spec's answer (``isValid``, ``invalidReason``, ``payer``)."""
        return self._facilitator("POST", "/verify", payment_payload, payment_requirements)

    def facilitator_settle(
        self, payment_payload: Mapping[str, Any], payment_requirements: Mapping[str, Any]
    ) -> dict[str, Any]:
        """``POST /x402/facilitator/settle``: the spec's answer (``success``, ``transaction``, ``errorReason``)."""
        return self._facilitator("POST", "/settle", payment_payload, payment_requirements, timeout=self.pay_timeout)

    def _facilitator(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None = None,
        requirements: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """A facilitator call: its spec body (a refusal included: 200, 400 or 409 with ``isValid``/``success``
        false), or :class:`PayIntentError` for anything else (401, 429, 5xx, no answer)."""
        body = None
        if payload is not None:
            version = payload.get("x402Version")
            body = {"x402Version": version, "paymentPayload": dict(payload), "paymentRequirements": requirements}
        response, decoded = self._send(method, f"/x402/facilitator{path}", body=body, timeout=timeout)
        spec = isinstance(decoded, dict) and ("kinds" in decoded or "isValid" in decoded or "success" in decoded)
        if spec and response.status_code in (200, 400, 409) and "data" not in decoded:
            return dict(decoded)
        raise _refusal(method, path, response, decoded)

    def _sign_solana(
        self, intent_id: str, requirement: Mapping[str, Any], keypair: Any, max_rent_lamports: int | None = None
    ) -> tuple[dict[str, Any], int]:
        """Fetch the transaction the service built for this payer, check it, and sign it as the buyer;
        returns the payload and the lamports the payer pays besides the USDC and nothing of the fee.

        A payment to a merchant whose USDC account does not exist also opens the account, the buyer
        paying its rent: the rules allow exactly that, and the transaction shows it. The rent is at
        least ``TOKEN_ACCOUNT_RENT`` whatever the answer's ``payer_pays_lamports`` says; above
        ``max_rent_lamports`` the transaction is not signed (``RENT_ABOVE_LIMIT``)."""
        from payintent import solana_tx

        built = self._request(
            "POST",
            f"/x402/intents/{intent_id}/solana-transaction",
            body={"payer": str(keypair.pubkey()), "network": requirement["network"]},
        )
        tx = solana_tx.decode(built["transaction"])
        fee_payer = str((requirement.get("extra") or {}).get("feePayer") or built["fee_payer"])
        # Sign only what the rules allow (exact amount, the merchant's account, the relay as fee payer only).
        signed = solana_tx.sign_as(tx, keypair)
        payment = solana_tx.check_payment(signed, dict(requirement), intent_id, fee_payer)
        rent = 0
        if payment.creates_payee_account:  # what the transaction does, not what the answer says
            rent = max(int(built.get("payer_pays_lamports") or 0), solana_tx.TOKEN_ACCOUNT_RENT)
        if max_rent_lamports is not None and rent > max_rent_lamports:
            raise PayIntentError(
                None,
                "RENT_ABOVE_LIMIT",
                f"this payment opens the merchant's USDC account: the payer would pay its rent of {rent} lamports, "
                f"above max_rent_lamports={max_rent_lamports}; nothing was signed",
                {"payer_pays_lamports": rent},
            )
        return {"transaction": solana_tx.encode(signed)}, rent

    def _await_outcome(self, intent_id: str) -> dict[str, Any] | None:
        """Read the intent now, then poll while it is pending (bounded). ``None``: never readable.

        Raises for a cancelled or expired intent (nothing more to try)."""
        intent: dict[str, Any] | None = None
        for poll in range(self.poll_attempts + 1):
            if poll:
                self._sleep(self.poll_interval)
            try:
                intent = self.get_intent(intent_id)
            except PayIntentError as err:
                if not err.transient:
                    raise
                continue
            if intent.get("status") == "paid":
                return intent
            if intent.get("status") in ("cancelled", "expired"):
                raise _not_payable(intent)
        return intent


def _solana_keypair(account: Any) -> Any:
    """A solders Keypair passed as the account (or None for EVM accounts and keys)."""
    try:
        from solders.keypair import Keypair
    except ImportError:  # pragma: no cover - solders is a dependency
        return None
    return account if isinstance(account, Keypair) else None


def _refusal(method: str, path: str, response: requests.Response, decoded: Any) -> PayIntentError:
    """The error of an answer that is not the one asked for: the API's code, or ``HTTP_<status>``."""
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if isinstance(error, dict) and error.get("code"):
        return PayIntentError(response.status_code, str(error["code"]), str(error.get("message", "")), decoded)
    return PayIntentError(
        response.status_code,
        f"HTTP_{response.status_code}",
        f"{method} {path}: unexpected answer {response.text[:200]!r}",
        decoded if decoded is not None else response.text,
    )


def _not_payable(intent: Mapping[str, Any]) -> PayIntentError:
    status = str(intent.get("status"))
    return PayIntentError(None, f"INTENT_{status.upper()}", f"intent {intent.get('intent_id')} is {status}", intent)
