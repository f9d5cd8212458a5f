"""What bench/load drives: the workload (client threads acting as random merchants) and the measured window."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import random
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

from bench import api as bench_api
from bench.load.measure import (
    EXPECTED,
    INTENTS,
    MAX_ATOMIC,
    MIN_ATOMIC,
    PAGE,
    PAY,
    Answer,
    Intent,
    Merchant,
    Mix,
    Record,
    Sample,
    call,
)
from bench.load.stack import LoadStack

# --- the workload ------------------------------------------------------------------------------------


def _amount(atomic: int) -> Decimal:
    return Decimal(atomic).scaleb(-6)


class Workload:
    """The client threads: each iteration acts as a random merchant."""

    def __init__(self, port: int, merchants: list[Merchant], buyers: list[Any], networks: list[str], mix: Mix) -> None:
        self.port = port
        self.merchants = merchants
        self.buyers = buyers
        self.networks = networks
        self.mix = mix
        self.record = Record()
        self.run_tag = secrets.token_hex(3)

    def request(
        self,
        op: str,
        merchant: Merchant,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Answer | None:
        """Send, time and record one request; returns the answer when its status is the expected one."""
        started = time.monotonic()
        try:
            answer = call(self.port, method, path, merchant.api_key, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            answer = Answer(0, f"socket: {exc!r}", {})
        seconds = time.monotonic() - started
        if answer.status == EXPECTED[op]:
            self.record.add(Sample(op, started, seconds, None))
            return answer
        refusal = answer.body if isinstance(answer.body, dict) else {}
        code = (refusal.get("error") or {}).get("code")
        error = f"HTTP {answer.status} {code or ''}".strip()
        self.record.add(Sample(op, started, seconds, error, f"{method} {path}: {str(answer.body)[:300]}"))
        return None

    def wrong(self, op: str, what: str, detail: str = "") -> None:
        """An answer with the right status but a wrong body: counted as an error of `op`."""
        self.record.add(Sample(op, time.monotonic(), 0.0, f"wrong body: {what}", detail))

    # operations -------------------------------------------------------------------------------------

    def create(self, merchant: Merchant, body: dict[str, Any], key: str, op: str = "create") -> dict[str, Any] | None:
        answer = self.request(op, merchant, "POST", INTENTS, body, {"Idempotency-Key": key})
        if answer is None:
            return None
        data: dict[str, Any] = answer.body["data"]
        if op == "replay" and answer.headers.get("idempotent-replayed") != "true":
            self.wrong(op, "no Idempotent-Replayed: true header")
        problem = self.intent_problem(data, body["amount_usdc"], body["order_id"], "pending")
        requirements = data.get("payment_requirements", [])
        atomic = int(body["amount_usdc"].scaleb(6))
        if sorted(r["network"] for r in requirements) != sorted(self.networks):
            problem = problem or "not one payment requirement per network"
        elif any(r["payTo"] != merchant.payout or int(r["maxAmountRequired"]) != atomic for r in requirements):
            problem = problem or "a requirement pays another wallet or amount"
        if problem:
            self.wrong(op, problem, str(data)[:300])
        return data

    @staticmethod
    def intent_problem(data: dict[str, Any], amount: Decimal, order_id: str, status: str) -> str:
        if data.get("status") != status:
            return f"status {data.get('status')}, expected {status}"
        if data.get("amount_usdc") != amount or data.get("order_id") != order_id:
            return "another amount or order_id"
        return ""

    def read(self, intent: Intent, status: str) -> None:
        answer = self.request("get", intent.merchant, "GET", f"{INTENTS}/{intent.intent_id}")
        if answer is None:
            return
        data = answer.body["data"]
        problem = self.intent_problem(data, _amount(intent.atomic), intent.order_id, status)
        if not problem and data.get("intent_id") != intent.intent_id:
            problem = "another intent"
        if not problem and status == "paid" and (data.get("tx_hash") or "").lower() != intent.tx_hash:
            problem = "tx_hash differs from /pay's"
        if problem:
            self.wrong("get", problem, f"{intent.intent_id}: {str(data)[:300]}")

    def list_pages(self, merchant: Merchant) -> None:
        total = None
        for offset in (0, PAGE):
            if total is not None and total <= offset:
                return
            answer = self.request("list", merchant, "GET", f"{INTENTS}?limit={PAGE}&offset={offset}")
            if answer is None:
                return
            data = answer.body["data"]
            ids = [str(i["intent_id"]) for i in data["intents"]]
            total = int(data["total"])
            if len(ids) > PAGE or data["limit"] != PAGE or data["offset"] != offset:
                self.wrong("list", "a page other than the one asked for", f"{len(ids)} intents, total {total}")
            self.record.saw_listed(merchant, ids)

    def cancel(self, intent: Intent) -> None:
        intent.outcome = "unknown"
        answer = self.request("cancel", intent.merchant, "DELETE", f"{INTENTS}/{intent.intent_id}")
        if answer is None:
            return
        if answer.body["data"].get("status") != "cancelled":
            self.wrong("cancel", "status other than cancelled", str(answer.body)[:300])
            return
        intent.outcome = "cancelled"
        self.read(intent, "cancelled")

    def pay(self, intent: Intent, requirements: list[dict[str, Any]], rng: random.Random) -> None:
        from payintent.eip3009 import sign_authorization

        network = rng.choice(self.networks)
        buyer = rng.choice(self.buyers)
        requirement = next((r for r in requirements if r["network"] == network), None)
        if requirement is None:  # counted as a wrong body of its create already
            return
        intent.outcome, intent.network, intent.buyer = "unknown", network, buyer.address
        signature = {
            "scheme": "exact",
            "network": network,
            "x402Version": 1,
            "payload": sign_authorization(buyer, requirement),
        }
        intent.pay_started = time.monotonic()
        answer = self.request(
            "pay", intent.merchant, "POST", PAY, {"intent_id": intent.intent_id, "payment_signature": signature}
        )
        intent.pay_seconds = time.monotonic() - intent.pay_started
        if answer is None:
            return
        data = answer.body["data"]
        intent.tx_hash = str(data.get("tx_hash") or "").lower()
        if (
            data.get("intent_id") != intent.intent_id
            or data.get("network") != network
            or data.get("amount_usdc") != _amount(intent.atomic)
            or str(data.get("buyer_address")).lower() != buyer.address.lower()
            or not intent.tx_hash
        ):
            self.wrong("pay", "another intent, network, amount or buyer, or no tx_hash", str(data)[:300])
            return
        intent.outcome = "paid"
        self.read(intent, "paid")

    # the loop ---------------------------------------------------------------------------------------

    def iteration(self, rng: random.Random, client: int, n: int) -> None:
        merchant = rng.choice(self.merchants)
        atomic = rng.randint(MIN_ATOMIC, MAX_ATOMIC)
        order_id = f"load-{self.run_tag}-{client}-{n}"
        body = {
            "amount_usdc": _amount(atomic),
            "order_id": order_id,
            "description": f"Load test order {n} of client {client}",
            "metadata": {"client": client, "iteration": n},
        }
        key = f"{order_id}-{secrets.token_hex(4)}"
        data = self.create(merchant, body, key)
        if data is None:
            return
        intent = Intent(merchant, str(data["intent_id"]), atomic, order_id)
        self.record.created(intent)
        if rng.random() < self.mix.replay:
            again = self.create(merchant, body, key, op="replay")
            if again is not None and again.get("intent_id") != intent.intent_id:
                self.wrong("replay", "a second intent for one key", f"{intent.intent_id}, {again.get('intent_id')}")
        self.read(intent, "pending")
        if rng.random() < self.mix.list:
            self.list_pages(merchant)
        roll = rng.random()
        if roll < self.mix.pay:
            self.pay(intent, data["payment_requirements"], rng)
        elif roll < self.mix.pay + self.mix.cancel:
            self.cancel(intent)

    def client(self, index: int, seed: int, deadline: float) -> None:
        rng = random.Random(seed * 1_000_003 + index)
        n = 0
        while time.monotonic() < deadline:
            self.iteration(rng, index, n)
            n += 1

    def run(self, clients: int, seconds: float, seed: int) -> None:
        deadline = time.monotonic() + seconds
        with ThreadPoolExecutor(max_workers=clients) as pool:
            futures = [pool.submit(self.client, i, seed, deadline) for i in range(clients)]
            for future in futures:
                future.result()


def start(stack: LoadStack, args: argparse.Namespace, stack_exit: contextlib.ExitStack) -> None:
    """Everything the run needs, in order; the relayers and the worker stop before PostgreSQL does."""
    stack.start_devnet(stack_exit)
    stack.start_redis()
    stack.write_chains_files()
    stack.start_receiver()
    database = stack_exit.enter_context(bench_api.postgresql(args.pg_url, stack.workdir))
    print(f"creating {args.merchants} merchants", flush=True)
    stack.create_merchants(database, args.merchants)
    stack_exit.callback(stack.stop_relayers)
    stack_exit.callback(stack.stop_worker)
    stack.start_api(stack_exit)
    stack.register_webhooks(args.webhook_merchants)
    stack.use_relayers(args.accounts, args.relayers)
    stack.start_worker()


def measure(stack: LoadStack, args: argparse.Namespace) -> tuple[Workload, dict[str, float], tuple[float, float]]:
    """The load: warm-up, then the measured part under the CPU meter; returns the workload, the CPU used and the
    measured part's bounds (time.monotonic())."""
    workload = Workload(stack.api_port, stack.merchants, stack.buyers, stack.networks, args.mix)
    meter = stack.load_cpu_groups()
    start = time.monotonic() + args.warmup
    stop = start + args.seconds
    timer = threading.Timer(args.warmup, meter.start)
    timer.start()
    print(f"load: {args.clients} clients, {args.warmup:.0f} s warm-up + {args.seconds:.0f} s", flush=True)
    workload.run(args.clients, args.warmup + args.seconds, args.seed)
    timer.join()
    used = meter.stop()
    return workload, used, (start, max(stop, time.monotonic()))
