"""What bench/pay measures and how: the recording JSON-RPC proxy (a subprocess), signature
verifications per second (a subprocess per eth_keys backend), the data of a run, and the RPC timing
of the in-process breakdown."""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import _common as common
from bench._common import ROOT, BenchError, pct
from harness.proxy import RECEIPT, Call

SECTION = "## Settlement (bench/pay.py)"
INTENTS = "/api/v1/x402/intents"
PAY = "/api/v1/x402/pay"
SETTLE = "/api/v1/x402/facilitator/settle"  # the facilitator API's (issue [4/5])
AMOUNT_ATOMIC = 1_250_000  # 1.25 USDC per payment
FUND_ATOMIC = 3 * AMOUNT_ATOMIC  # what each buyer gets: a second payment from one buyer would show
MINT_SELECTOR = "0x40c10f19"  # mint(address,uint256), TestUSDC (owner: the devnet's deployer)
BALANCE_OF_SELECTOR = "0x70a08231"
OVERHEAD_AIM_MS = 15.0


# The JSON-RPC recording proxy is harness.proxy (`python -m harness.proxy record ...`): its Call is a run's record.


# --- signature verifications per second (runs as a subprocess per eth_keys backend) -------------

SIG_REQUIREMENT = {
    "network": "eip155:84532",
    "asset": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
    "payTo": "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    "maxAmountRequired": str(AMOUNT_ATOMIC),
    "usdcDomainName": "USDC",
    "extra": {"name": "USDC", "version": "2"},
}


def _rate(fn: Callable[[int], Any], seconds: float) -> float:
    """Calls per second of fn(i), single-threaded, over about `seconds`."""
    for i in range(3):
        fn(i)
    count = 0
    started = time.perf_counter()
    while True:
        for _ in range(10):
            fn(count)
            count += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return count / elapsed


def run_sig_worker(seconds: float) -> int:
    from eth_account import Account
    from eth_account.messages import _hash_eip191_message, encode_typed_data
    from eth_keys.backends import get_backend

    from backend.rails.evm.terms import parse_evm_payload, verify_evm_authorization
    from payintent.eip3009 import MESSAGE_TYPES, domain_of, message_of, recover_authorizer, sign_authorization

    accounts = [Account.from_key(secrets.token_bytes(32)) for _ in range(16)]
    payloads = [sign_authorization(a, SIG_REQUIREMENT) for a in accounts]
    domain = domain_of(SIG_REQUIREMENT)
    n = len(payloads)
    for payload, account in zip(payloads, accounts, strict=True):
        if recover_authorizer(domain, payload) != account.address:
            raise BenchError("recover_authorizer did not return the signer")
    signables = [
        encode_typed_data(domain_data=domain, message_types=MESSAGE_TYPES, message_data=message_of(p)) for p in payloads
    ]
    hashes = [_hash_eip191_message(s) for s in signables]
    signatures = [bytes.fromhex(p["signature"][2:]) for p in payloads]
    now = int(time.time())

    def full_verify(i: int) -> None:
        verify_evm_authorization(parse_evm_payload(payloads[i % n]), SIG_REQUIREMENT, now)

    result = {
        "backend": type(get_backend()).__name__,
        "recover": _rate(lambda i: recover_authorizer(domain, payloads[i % n]), seconds),
        "verify": _rate(full_verify, seconds / 2),
        "encode": _rate(
            lambda i: encode_typed_data(
                domain_data=domain, message_types=MESSAGE_TYPES, message_data=message_of(payloads[i % n])
            ),
            seconds / 2,
        ),
        "ecrecover": _rate(lambda i: Account._recover_hash(hashes[i % n], signature=signatures[i % n]), seconds / 2),
        "sign": _rate(lambda i: sign_authorization(accounts[i % n], SIG_REQUIREMENT), seconds / 2),
    }
    print("SIG_RESULT " + json.dumps(result), flush=True)
    return 0


def signature_rates(procs: common.ProcessSet, seconds: float, native: bool) -> list[dict[str, Any]]:
    backends = ["eth_keys.backends.CoinCurveECCBackend"] + (["eth_keys.backends.NativeECCBackend"] if native else [])
    results = []
    for backend in backends:
        env = {**os.environ, "ECC_BACKEND_CLASS": backend, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "bench.pay", "--sig-worker", "--sig-seconds", str(seconds)]
        proc = procs.start(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=120 + 10 * seconds)
        finally:
            procs.stop(proc)
        line = next((x for x in out.splitlines() if x.startswith("SIG_RESULT ")), None)
        if line is None:
            raise BenchError(f"the signature benchmark ({backend}) printed no result:\n{out[-2000:]}")
        results.append(json.loads(line.removeprefix("SIG_RESULT ")))
    return results


# --- small helpers ---------------------------------------------------------------------------------


def rpc(url: str, method: str, params: list[Any] | None = None, timeout: float = 10) -> Any:
    import requests

    body = requests.post(
        url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params or []}, timeout=timeout
    ).json()
    if "error" in body:
        raise BenchError(f"{method} on {url}: {body['error']}")
    return body["result"]


def rpc_batch(url: str, method: str, params_list: list[list[Any]], chunk: int = 100) -> list[Any]:
    import requests

    results: list[Any] = []
    with requests.Session() as session:
        for start in range(0, len(params_list), chunk):
            batch = [
                {"jsonrpc": "2.0", "id": start + i, "method": method, "params": p}
                for i, p in enumerate(params_list[start : start + chunk])
            ]
            answers = sorted(session.post(url, json=batch, timeout=60).json(), key=lambda a: a["id"])
            for answer in answers:
                if "error" in answer:
                    raise BenchError(f"{method} on {url}: {answer['error']}")
                results.append(answer["result"])
    return results


def ts(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):  # SQLite (payintent dev's database) gives raw SQL's timestamps as text
        value = dt.datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return float(value.timestamp())


# --- data of a run ---------------------------------------------------------------------------------


@dataclass
class RunConfig:
    key: str
    label: str
    accounts: int  # relay accounts per chain
    relayers: int  # `payintent relayer` processes
    clients: int
    payments: int
    block_time: int = 0  # 0: Anvil automines each transaction at once


@dataclass
class Payment:
    network: str
    buyer: Any  # LocalAccount
    intent_id: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    t0: float = 0.0
    t1: float = 0.0
    status: int = 0
    code: str = ""
    tx_hash: str = ""
    created: float | None = None  # claim (settlements.created_at)
    submitted: float | None = None  # just before the broadcast
    finished: float | None = None  # the intent is marked paid
    calls: list[Call] = field(default_factory=list)

    @property
    def latency(self) -> float:
        return self.t1 - self.t0


def chain_seconds(calls: list[Call]) -> float:
    """RPC time plus the receipt wait (first receipt poll to the last one's answer)."""
    receipts = [c for c in calls if c.method == RECEIPT]
    total = sum(c.seconds for c in calls if c.method != RECEIPT)
    if receipts:
        total += max(c.t_out for c in receipts) - min(c.t_in for c in receipts)
    return total


PHASES = ("api", "queue", "send", "finish")
PHASE_NAMES = {
    "api": "request → claim",
    "queue": "claim → broadcast",
    "send": "broadcast → paid",
    "finish": "paid → response",
}
PHASE_NOTES = {
    "api": "HTTP, API key, schema, load intent, verify, nonce/balance/block reads",
    "queue": "claim commit, enqueue, RQ pickup, relayer checks, gas estimate, lease, nonce, fees, sign",
    "send": "mark_submitted commit, broadcast, receipt and confirmations wait, start of complete_settlement",
    "finish": "complete commit and event, notify, BLPOP wake-up, read result, answer",
}


@dataclass
class RunResult:
    config: RunConfig
    sent: list[Payment]  # the measured ones (warm-up excluded)
    seconds: float
    cpu_ms: dict[str, float]  # CPU ms per settlement, per component
    machine_busy: float  # share of all cores busy during the run
    problems: list[str]
    unattributed_calls: int = 0
    busy_before: float = 0.0
    other_share: float = 0.0  # share of the machine's CPU used by processes not ours during the run
    attempts: int = 1
    rpc_api: float = 0.0
    rpc_relayer: float = 0.0
    rpc_methods: Counter[str] = field(default_factory=Counter)  # "API: eth_call" -> calls per payment

    @property
    def payments(self) -> list[Payment]:
        """The settled ones (answered 200, confirmed): latency and time statistics are over these."""
        return [p for p in self.sent if p.status == 200 and p.finished is not None]

    @property
    def errors(self) -> int:
        return len(self.sent) - len(self.payments)

    @property
    def rate(self) -> float:
        return len(self.payments) / self.seconds if self.seconds else 0.0

    def ms(self, fn: Callable[[Payment], float], q: float) -> float:
        return 1000 * pct([fn(p) for p in self.payments], q)

    def chain(self, p: Payment) -> float:
        return chain_seconds([c for c in p.calls if p.t0 <= c.t_in <= p.t1])

    def overhead(self, p: Payment) -> float:
        return p.latency - self.chain(p)

    def phase(self, p: Payment, phase: str) -> tuple[float, float]:
        """(wall, chain) seconds of a phase of one payment."""
        bounds = [p.t0, p.created, p.submitted, p.finished, p.t1]
        i = PHASES.index(phase)
        start, end = bounds[i], bounds[i + 1]
        if start is None or end is None:
            return 0.0, 0.0
        return end - start, chain_seconds([c for c in p.calls if start <= c.t_in < end])


# --- the in-process breakdown ------------------------------------------------------------------------


class RpcLog:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.methods: dict[str, Counter[str]] = defaultdict(Counter)  # step -> RPC methods of its last run

    def mark(self) -> int:
        return len(self.calls)

    def between(self, start: int, end: int | None = None) -> tuple[float, int]:
        chosen = self.calls[start:end]
        return sum(s for _, s in chosen), len(chosen)

    def note(self, step: str, start: int, end: int | None = None) -> None:
        self.methods[step] = Counter(m for m, _ in self.calls[start:end])


def _rpc_methods(data: Any) -> str:
    """A request body's JSON-RPC method, or ``batch:`` and its methods."""
    try:
        body = json.loads(data)
    except (TypeError, ValueError):
        return "?"
    if isinstance(body, list):
        return "batch:" + ",".join(str(item.get("method")) for item in body if isinstance(item, dict))
    return str(body.get("method")) if isinstance(body, dict) else "?"


def timed_chains(registry: Any, log: RpcLog) -> dict[str, Any]:
    """The service's own EvmChain clients (``backend.chains.evm.evm_chain``: the instances the rail and the
    relayer use in this process), with every HTTP request their web3 provider's session sends (one call, or a
    batch) timed into `log` (answers web3 serves from its cache are not requests)."""
    from backend.chains.evm import evm_chain

    chains = {}
    for network in registry:
        chain = evm_chain(network)
        provider = chain.w3.provider
        manager = provider._request_session_manager
        post = manager.make_post_request  # every HTTP POST: web3's calls (under its cache and retries) and batches

        def timed_post(uri: str, data: Any, *args: Any, post: Callable[..., Any] = post, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return post(uri, data, *args, **kwargs)
            finally:
                log.calls.append((_rpc_methods(data), time.perf_counter() - started))

        manager.make_post_request = timed_post
        chains[network.network] = chain
    return chains


# One step of one payment in the breakdown: wall seconds, seconds inside web3's HTTP provider (its
# make_request: requests, HTTP, the proxy, the chain), RPC calls, seconds at the chain (as the proxy saw it).
Sample = tuple[float, float, int, float]
# The rows, in order. The API's come from backend.timing's steps in submit_payment (STEP_ROWS), the
# relayer's from the in-process relay half (scenarios.relay_in_process); rows starting with two spaces
# are comparisons, not counted in the totals.
BREAKDOWN_STEPS = (
    ("load intent", "API", "flow.load_payable_intent (DB)"),
    ("check payable", "API", "services.check_payable"),
    ("normalize", "API", "x402.normalize_payment_signature (any x402 form to one)"),
    ("requirement", "API", "PaymentSubmission.of + services.requirement_for + network_of"),
    ("payTo current", "API", "services.check_pay_to_current (DB)"),
    ("asset current", "API", "the requirement's USDC contract is the network's (else REQUIREMENT_OUTDATED)"),
    ("verify", "API", "rail.parse_payment: parse_evm_payload + verify_evm_authorization"),
    ("  of it: signature", "API", "recover_authorizer alone (EIP-712 encode + ecrecover)"),
    ("chain reads", "API", "rails.evm.rail.read_pre_claim_state: nonce, code, balance, latest block (one batch)"),
    ("relay budget", "API", "flow._budget (the relay budget's cost bounds)"),
    ("claim", "API", "services.claim: insert, conditional update, commit"),
    ("enqueue", "API", "flow.enqueue_settlement (the RQ job; here to a queue no relayer serves)"),
    ("load settlement", "relayer", "services.get_settlement"),
    ("pre-check", "relayer", "reconcile.finish_from_chain (only for a settlement sent before)"),
    ("intent check", "relayer", "is the intent paid by another settlement? (DB)"),
    ("code read again", "relayer", "EvmChain.has_code (code can appear after /pay)"),
    ("latest block time", "relayer", "EvmChain.block_timestamp (validAfter passed on chain?)"),
    ("fees", "relayer", "evm.fees (base fee and tip)"),
    ("lease, nonce, fees, sign", "relayer", "evm.send up to before_broadcast: lease, balance, estimate, nonce, sign"),
    ("mark submitted", "relayer", "services.mark_submitted (DB)"),
    ("broadcast", "relayer", "evm.send after before_broadcast (eth_sendRawTransaction)"),
    ("receipt", "relayer", "rails.evm.watch.wait_receipt"),
    ("confirmations", "relayer", "rails.evm.watch.wait_confirmations"),
    ("complete", "relayer", "services.get_settlement + complete_settlement (DB, event)"),
    ("wait", "API", "BLPOP for the relayer's word (here the relay half already ran: the wake-up alone)"),
    ("result", "API", "flow.settlement_result (DB)"),
)
# backend.timing's step names in submit_payment -> the rows above (check_on_chain: its reads are rows).
STEP_ROWS = {
    "load_payable_intent": "load intent",
    "check_payable": "check payable",
    "normalize_payment_signature": "normalize",
    "requirement_for": "requirement",
    "check_pay_to_current": "payTo current",
    "check_asset_current": "asset current",
    "parse_payment": "verify",
    "chain_reads": "chain reads",
    "budget": "relay budget",
    "claim": "claim",
    "enqueue_settlement": "enqueue",
    "wait_settled": "wait",
    "settlement_result": "result",
}
