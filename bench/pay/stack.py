"""The stack bench/pay needs: the devnet, Redis, PostgreSQL, the proxy, the API and the relayers."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import subprocess
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import api as bench_api
from bench._common import HOST, BenchError
from bench.pay.measure import (
    AMOUNT_ATOMIC,
    BALANCE_OF_SELECTOR,
    FUND_ATOMIC,
    INTENTS,
    MINT_SELECTOR,
    PAY,
    RECEIPT,
    SETTLE,
    Call,
    Payment,
    rpc,
    rpc_batch,
    ts,
)
from harness import audit, proxy
from harness.ready import wait_all_registered

# The most relayer processes a run starts (scenarios.RunConfig, runscenarios, __main__'s capacity run: 4), and the
# connections the benchmark's own reads and the CLI calls may add: PostgreSQL's max_connections (connection_budget).
MOST_RELAYERS = 4
CONNECTIONS_OF_OUR_OWN = 20

# --- the stack ---------------------------------------------------------------------------------------


class Stack:
    """The devnet, Redis, PostgreSQL, the proxy, the API and the relayers of one benchmark run."""

    def __init__(self, workdir: Path, procs: common.ProcessSet, workers: int, wait_idle: float = 20) -> None:
        self.wait_idle = wait_idle
        self.proxy_port = 0
        self.proxy_proc: subprocess.Popen[Any] | None = None
        self.workdir = workdir
        self.procs = procs
        self.workers = workers
        self.relayers: list[subprocess.Popen[Any]] = []
        self.relayer_setup: tuple[int, int] | None = None
        self.expected_payout: Counter[str] = Counter()
        self.paid_intents: set[str] = set()
        self.tx_hashes: set[str] = set()
        self.pay_timeout = 90.0  # a client gives up on /pay after this many seconds (status 0)
        # The API's SECRET_KEY, known here: the facilitator API's intent ids are derived under it, so the bench
        # knows each payment's intent (as it does for /pay's) and the drain and the audit work unchanged.
        self.secret_key = secrets.token_hex(32)

    # devnet ---------------------------------------------------------------------------------------

    def start_devnet(self, stack: contextlib.ExitStack) -> None:
        import devnet

        os.environ["PAYINTENT_VAR_DIR"] = str(self.workdir / "var")
        stack.callback(devnet.down)
        self.devnet_info, _ = devnet.up(devnet.free_port_base())
        devnet_dir = self.workdir / "var" / "devnet"
        state = json.loads((devnet_dir / "state.json").read_text())
        self.anvil_pids = [int(n["pid"]) for n in state["networks"].values()]
        self.deployer_key = state["deployer"]["private_key"]
        self.chains_doc = json.loads(Path(self.devnet_info["chains_file"]).read_text())
        # The bench measures EVM settlement: it leaves out the devnet's Solana network (and its relay key).
        self.chains_doc["networks"] = [n for n in self.chains_doc["networks"] if n.get("kind", "evm") == "evm"]
        evm_networks = {n["network"] for n in self.chains_doc["networks"]}
        relay_keys = json.loads((devnet_dir / "relay_keys.json").read_text())
        self.relay_keys: dict[str, list[str]] = {n: k for n, k in relay_keys.items() if n in evm_networks}
        self.networks = [n["network"] for n in self.chains_doc["networks"]]
        self.rpc_url = {n["network"]: n["rpc_url"] for n in self.chains_doc["networks"]}
        self.usdc = {n["network"]: n["usdc_address"] for n in self.chains_doc["networks"]}
        self.relay_addresses = {n["network"]: n["relay_addresses"] for n in self.chains_doc["networks"]}
        from eth_account import Account

        for network, keys in self.relay_keys.items():
            if [Account.from_key(k).address for k in keys] != self.relay_addresses[network]:
                raise BenchError(f"relay_keys.json and chains.json list different relays for {network}")
        self.anvil_version = subprocess.run(
            [state.get("anvil_binary") or self._anvil_binary(), "--version"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.splitlines()[0:1]

    @staticmethod
    def _anvil_binary() -> str:
        from devnet import anvil

        return anvil.anvil_binary()

    # redis and the proxy --------------------------------------------------------------------------

    def start_redis(self) -> None:
        from redis import Redis

        from harness import ready, redis_server

        self.redis_proc, self.redis_url = redis_server.start_redis(self.workdir, procs=self.procs, timeout=15)
        ready.wait_until("redis-server", lambda: ready.redis_ping(self.redis_url), 15, self.redis_proc)
        self.redis = Redis.from_url(self.redis_url)
        self.redis_version = str(self.redis.info("server").get("redis_version", "?"))

    def start_proxy(self) -> None:
        upstreams = {network.split(":")[1]: int(url.rsplit(":", 1)[1]) for network, url in self.rpc_url.items()}
        self.proxy_proc, self.proxy_port = proxy.start_recording_proxy(
            self.procs, upstreams, self.workdir / "proxy.log"
        )

    def proxy_records(self) -> list[Call]:
        return proxy.proxy_records(self.proxy_port) if self.proxy_port else []

    def write_chains_files(self) -> None:
        """Chains files pointing at the proxy: with all relay accounts, and with the first one only."""
        self.chains_file: dict[int, str] = {}
        for count in (1, len(next(iter(self.relay_addresses.values())))):
            doc = copy.deepcopy(self.chains_doc)
            for network in doc["networks"]:
                if self.proxy_port:
                    network["rpc_url"] = f"http://{HOST}:{self.proxy_port}/{network['network'].split(':')[1]}"
                network["relay_addresses"] = network["relay_addresses"][:count]
            path = self.workdir / f"chains-{count}.json"
            path.write_text(json.dumps(doc, indent=2))
            self.chains_file[count] = str(path)

    # database, merchant, API ----------------------------------------------------------------------

    def env(self, accounts: int | None = None) -> dict[str, str]:
        all_accounts = max(self.chains_file)
        env = common.service_env(
            self.workdir,
            ("RELAY_KEYS", "RELAY_KEYS_FILE", "ECC_BACKEND_CLASS"),
            DATABASE_URL=self.database.url,
            REDIS_URL=self.redis_url,
            CHAINS_FILE=self.chains_file[accounts or all_accounts],
        )
        if accounts is not None and accounts < all_accounts:
            env["RELAY_KEYS"] = json.dumps({n: keys[:accounts] for n, keys in self.relay_keys.items()})
        env["SECRET_KEY"] = self.secret_key
        return env

    def prepare_database(self, database: bench_api.Database) -> None:
        from eth_account import Account

        self.database = database
        env = self.env()
        created = common.create_merchant(env, "bench-pay@example.com")
        self.merchant_id = created["merchant_id"]
        self.api_key = created["api_key"]
        self.payout = Account.from_key(secrets.token_bytes(32)).address
        for network in self.networks:
            common.payintent(env, "wallet", "set", "--merchant", self.merchant_id, "--network", network,
                             "--address", self.payout)  # fmt: skip

    def connection_budget(self) -> int:
        """PostgreSQL connections the stack may open at once: each API worker's pool, MOST_RELAYERS relayers' (the
        pools' rule: backend.app), and room for the benchmark's own reads and the CLI's. PostgreSQL's default
        max_connections (100) is below it: the 256-payer runs met "too many clients" (docs/benchmarks.md)."""
        from backend.app import most_connections
        from backend.config import MAX_RELAYER_THREADS

        relayer = most_connections(MAX_RELAYER_THREADS)  # whatever RELAYER_THREADS is
        return self.workers * most_connections() + MOST_RELAYERS * relayer + CONNECTIONS_OF_OUR_OWN

    def start_api(self, stack: contextlib.ExitStack) -> None:
        # Threads as `payintent serve` runs them (WEB_THREADS' default): a /pay waiting for its block holds a thread.
        self.gunicorn = bench_api.Gunicorn(self.workers, threads=32)
        serving = bench_api.serve(
            "backend.app:create_app()", self.gunicorn, self.env(), "/healthz", self.workdir, self.procs
        )
        self.api_port, self.api_pid = stack.enter_context(serving)

    # relayers -------------------------------------------------------------------------------------

    def use_relayers(self, accounts: int, count: int) -> None:
        if self.relayer_setup == (accounts, count) and all(p.poll() is None for p in self.relayers):
            return
        self.stop_relayers()
        env = self.env(accounts)
        for i in range(count):
            log = self.workdir / f"relayer-a{accounts}-{i}.log"
            self.relayers.append(common.start_service(self.procs, "relayer", env, log))

        def check() -> None:
            dead = [p for p in self.relayers if p.poll() is not None]
            if dead:
                logs = "".join(p.read_text()[-1500:] for p in self.workdir.glob(f"relayer-a{accounts}-*.log"))
                raise BenchError(f"a relayer exited with {dead[0].returncode}:\n{logs}")

        from backend.queueing import relayer_queue

        first = relayer_queue("relayer", self.networks[0])  # a relayer listens on every network it has keys for
        wait_all_registered(self.redis, first, self.relayers, "relayers", check, timeout=90, poll=0.2)
        self.relayer_setup = (accounts, count)

    def stop_relayers(self) -> None:
        for proc in self.relayers:
            self.procs.stop(proc, grace=20)
        self.relayers = []
        self.relayer_setup = None

    def log_problems(self) -> list[str]:
        """Errors and warnings the relayers, the API and the proxy logged."""
        problems = []
        logs = [*self.workdir.glob("relayer-*.log"), *self.workdir.glob("gunicorn-*.log"), self.workdir / "proxy.log"]
        for log in sorted(p for p in logs if p.exists()):
            text = log.read_text(errors="replace")
            bad = [
                line
                for line in text.splitlines()
                if "Traceback" in line or "ERROR" in line or "WARNING" in line or line.startswith("proxy:")
            ]
            if bad:
                problems.append(f"{log.name}: {len(bad)} error/warning lines, e.g. {bad[0][:200]}")
        return problems

    def cpu_groups(self) -> common.CpuGroups:
        pg = self.database.pids
        return common.CpuGroups(
            {
                "api": lambda: common.process_tree(self.api_pid),
                "relayers": lambda: {p.pid for p in self.relayers},
                "postgres": pg,
                "redis": lambda: {self.redis_proc.pid},
                "anvil": lambda: set(self.anvil_pids),
                "proxy": lambda: {self.proxy_proc.pid} if self.proxy_proc else set(),
            },
            "client",
        )

    def set_block_time(self, seconds: int) -> None:
        """0: automine (a block per transaction, at once); n: a block every n seconds, no automine."""
        for url in self.rpc_url.values():
            if seconds:
                rpc(url, "evm_setAutomine", [False])
                rpc(url, "evm_setIntervalMining", [seconds])
            else:
                rpc(url, "evm_setIntervalMining", [0])
                rpc(url, "evm_setAutomine", [True])

    # buyers ---------------------------------------------------------------------------------------

    def fund(self, buyers: dict[str, list[Any]]) -> None:
        """Mint FUND_ATOMIC test USDC to every buyer, signed by the devnet's deployer (the token's owner)."""
        from eth_account import Account

        deployer = Account.from_key(self.deployer_key)
        for network, accounts in buyers.items():
            url = self.rpc_url[network]
            chain_id = int(network.split(":")[1])
            nonce = int(rpc(url, "eth_getTransactionCount", [deployer.address, "pending"]), 16)
            base_fee = int(rpc(url, "eth_getBlockByNumber", ["latest", False])["baseFeePerGas"], 16)
            raws = []
            for i, buyer in enumerate(accounts):
                data = MINT_SELECTOR + buyer.address[2:].lower().rjust(64, "0") + f"{FUND_ATOMIC:064x}"
                tx = {
                    "type": 2, "chainId": chain_id, "nonce": nonce + i, "to": self.usdc[network], "value": 0,
                    "gas": 150_000, "maxFeePerGas": 2 * base_fee + 10**9, "maxPriorityFeePerGas": 10**9, "data": data,
                }  # fmt: skip
                raws.append(["0x" + bytes(deployer.sign_transaction(tx).raw_transaction).hex()])
            hashes = rpc_batch(url, "eth_sendRawTransaction", raws)
            deadline = time.monotonic() + 60
            while True:
                receipts = rpc_batch(url, RECEIPT, [[h] for h in hashes])
                if all(r is not None for r in receipts):
                    break
                if time.monotonic() > deadline:
                    raise BenchError(f"minting to the buyers on {network} did not finish")
                time.sleep(0.2)
            if any(int(r["status"], 16) != 1 for r in receipts):
                raise BenchError(f"a mint to a buyer on {network} failed")
        for network, accounts in buyers.items():  # spot check
            if self.token_balance(network, accounts[-1].address) != FUND_ATOMIC:
                raise BenchError(f"a buyer on {network} did not get {FUND_ATOMIC} atomic USDC")

    def token_balance(self, network: str, address: str) -> int:
        data = BALANCE_OF_SELECTOR + address[2:].lower().rjust(64, "0")
        return int(rpc(self.rpc_url[network], "eth_call", [{"to": self.usdc[network], "data": data}, "latest"]), 16)

    def token_balances(self, network: str, addresses: list[str]) -> list[int]:
        params = [
            [{"to": self.usdc[network], "data": BALANCE_OF_SELECTOR + a[2:].lower().rjust(64, "0")}, "latest"]
            for a in addresses
        ]
        return [int(x, 16) for x in rpc_batch(self.rpc_url[network], "eth_call", params)]

    # payments -------------------------------------------------------------------------------------

    def create_intents(self, payments: list[Payment], tag: str) -> None:
        from payintent.eip3009 import sign_authorization

        def one(item: tuple[int, Payment]) -> None:
            i, p = item
            body = {"amount_usdc": AMOUNT_ATOMIC / 1_000_000, "order_id": f"{tag}-{i}"}
            created = bench_api.expect(
                201, bench_api.request(self.api_port, "POST", INTENTS, self.api_key, body, timeout=60), "POST intents"
            )["data"]
            requirement = next(r for r in created["payment_requirements"] if r["network"] == p.network)
            p.intent_id = created["intent_id"]
            p.body = {
                "intent_id": p.intent_id,
                "payment_signature": {
                    "scheme": "exact",
                    "network": p.network,
                    "x402Version": 1,
                    "payload": sign_authorization(p.buyer, requirement),
                },
            }

        with ThreadPoolExecutor(max_workers=min(4, self.workers)) as pool:
            list(pool.map(one, enumerate(payments)))

    def prepare_settles(self, payments: list[Payment]) -> None:
        """The facilitator API's requests (issue [4/5]): each payment a resource server's v2 requirement (our payout,
        the devnet's USDC, the domain as an intent publishes it) and its buyer's PaymentPayload; the intent id the
        API derives for it (``backend.facilitator.services.derived_intent_id``, under this stack's SECRET_KEY)."""
        from backend.facilitator.services import derived_intent_id
        from payintent.eip3009 import sign_authorization

        extra: dict[str, Any] = {}
        for network in {p.network for p in payments}:
            answer = bench_api.request(self.api_port, "POST", INTENTS, self.api_key, {"amount_usdc": 0.01}, timeout=60)
            published = bench_api.expect(201, answer, "POST intents")["data"]["payment_requirements"]
            extra[network] = next(r for r in published if r["network"] == network)["extra"]
        for p in payments:
            requirement = {"scheme": "exact", "network": p.network, "amount": str(AMOUNT_ATOMIC),
                           "asset": self.usdc[p.network], "payTo": payout_of(self, p.network),
                           "maxTimeoutSeconds": 120, "extra": extra[p.network]}  # fmt: skip
            signed = sign_authorization(p.buyer, {**requirement, "maxAmountRequired": requirement["amount"]})
            authorization = {k: v for k, v in signed.items() if k != "signature"}
            payload = {"x402Version": 2, "accepted": requirement,
                       "payload": {"signature": signed["signature"], "authorization": authorization},
                       "resource": {"url": "https://bench.example/report", "description": "bench"}}  # fmt: skip
            p.body = {"x402Version": 2, "paymentPayload": payload, "paymentRequirements": requirement}
            p.intent_id = derived_intent_id(self.secret_key, self.merchant_id, p.network, p.buyer.address,
                                            signed["nonce"])  # fmt: skip

    def pay(self, p: Payment) -> None:
        settle = "paymentPayload" in p.body  # prepared by prepare_settles: the facilitator API's settle
        p.t0 = time.time()
        started = time.perf_counter()
        try:
            p.status, answer = bench_api.request(
                self.api_port, "POST", SETTLE if settle else PAY, self.api_key, p.body, timeout=self.pay_timeout
            )
        except OSError as exc:
            p.status, answer = 0, {"error": {"code": f"socket: {exc}"}}
        p.t1 = p.t0 + (time.perf_counter() - started)
        if settle and isinstance(answer, dict) and not answer.get("success"):
            p.status, p.code = p.status if p.status != 200 else 299, str(answer.get("errorReason"))  # 299: refused
        elif settle and isinstance(answer, dict) and p.status == 200:
            p.tx_hash = str(answer["transaction"]).lower()
        elif isinstance(answer, dict) and p.status == 200:
            p.tx_hash = str(answer["data"]["tx_hash"]).lower()
        elif isinstance(answer, dict):
            p.code = str((answer.get("error") or {}).get("code"))
        else:
            p.code = str(answer)[:80]

    def drive(self, payments: list[Payment], clients: int) -> float:
        """POST /pay for every payment from `clients` threads; returns the wall seconds."""
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            list(pool.map(self.pay, payments))
        return time.perf_counter() - started

    # checks ---------------------------------------------------------------------------------------

    def settlement_rows(self, intent_ids: list[str]) -> tuple[dict[str, list[Any]], dict[str, Any], Counter[str]]:
        import sqlalchemy as sa

        engine = sa.create_engine(self.database.url, poolclass=sa.pool.NullPool)
        ids = sa.bindparam("ids", expanding=True)
        try:
            with engine.connect() as conn:
                settlements: dict[str, list[Any]] = defaultdict(list)
                query = sa.text(
                    "SELECT intent_id, id, payer, network, status, tx_hash, created_at, submitted_at, finished_at, "
                    "failure_code, failure_reason FROM settlements WHERE intent_id IN :ids"
                ).bindparams(ids)
                for row in conn.execute(query, {"ids": intent_ids}):
                    settlements[row.intent_id].append(row)
                query = sa.text("SELECT id, status, settlement_id, tx_hash FROM intents WHERE id IN :ids").bindparams(
                    ids
                )
                intents = {row.id: row for row in conn.execute(query, {"ids": intent_ids})}
                query = sa.text(
                    "SELECT intent_id, count(*) AS n FROM events "
                    "WHERE type = 'payment.completed' AND intent_id IN :ids GROUP BY intent_id"
                ).bindparams(ids)
                events = Counter({row.intent_id: int(row.n) for row in conn.execute(query, {"ids": intent_ids})})
        finally:
            engine.dispose()
        return settlements, intents, events

    def check(self, payments: list[Payment], what: str) -> list[str]:
        """Each payment answered 200 and settled exactly once, or was refused and moved no money: in the
        database (settlements, intent, events) and on chain (buyer, merchant, transaction)."""
        problems = []
        codes = Counter(f"{p.status} {p.code}".strip() for p in payments if p.status != 200 or not p.tx_hash)
        if codes:
            problems.append(f"{what}: /pay answers other than 200: {dict(codes)}")
        settlements, intents, events = self.settlement_rows([p.intent_id for p in payments])
        counts: Counter[str] = Counter()
        paid: list[audit.Paid] = []
        for p in payments:
            rows = settlements.get(p.intent_id, [])
            intent = intents.get(p.intent_id)
            confirmed = [r for r in rows if r.status == "confirmed"]
            paid += [audit.Paid(p.network, p.buyer.address, self.payout, AMOUNT_ATOMIC, r.tx_hash) for r in confirmed]
            for r in rows:
                if r.status != "confirmed":
                    counts[f"settlement left {r.status} {r.failure_code or ''} {(r.failure_reason or '')[:80]}"] += 1
            if p.intent_id in self.paid_intents:
                counts["intent paid in an earlier run"] += 1
            self.paid_intents.add(p.intent_id)
            if p.status != 200:
                if confirmed or (intent is not None and intent.status == "paid"):
                    counts["paid although /pay did not answer 200"] += 1
                continue
            if len(rows) != 1 or len(confirmed) != 1:
                counts[f"{len(rows)} settlements, {len(confirmed)} confirmed, for a payment answered 200"] += 1
            if intent is None or intent.status != "paid":
                counts["intent not paid after a 200"] += 1
            elif (intent.tx_hash or "").lower() != p.tx_hash:
                counts["intent tx_hash differs from the /pay answer"] += 1
            if events[p.intent_id] != 1:
                counts[f"{events[p.intent_id]} payment.completed events"] += 1
            if confirmed:
                row = confirmed[0]
                p.created, p.submitted, p.finished = ts(row.created_at), ts(row.submitted_at), ts(row.finished_at)
                if row.payer.lower() != p.buyer.address.lower() or row.network != p.network:
                    counts["settlement payer or network differs"] += 1
                if (row.tx_hash or "").lower() in self.tx_hashes:
                    counts["transaction reused by two settlements"] += 1
                self.tx_hashes.add((row.tx_hash or "").lower())
        problems += [f"{what}: {n} x {kind.strip()}" for kind, n in counts.items()]
        # On chain (harness.audit): each buyer was funded FUND_ATOMIC, the merchant holds what earlier checks
        # expected; each confirmed payment moved its amount once, and nothing else moved.
        before = {(p.network, p.buyer.address): FUND_ATOMIC for p in payments}
        before.update({(n, self.payout): self.expected_payout[n] for n in self.networks})
        for p in paid:
            self.expected_payout[p.network] += p.atomic
        problems += [f"{what}: {problem}" for problem in audit.audit(self.tokens(), paid, before)]
        return problems

    def tokens(self) -> dict[str, audit.Token]:
        """Each network's chain (Anvil itself, not the proxy) and USDC contract, for harness.audit."""
        return {n: audit.Token(self.rpc_url[n], self.usdc[n]) for n in self.networks}


def payout_of(stack: Stack, network: str) -> str:
    payout = stack.payout
    return payout[network] if isinstance(payout, dict) else str(payout)
