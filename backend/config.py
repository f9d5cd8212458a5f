"""Settings read once from the environment.

Every setting has a default that makes the local stack work on a fresh clone; production
deployments set them explicitly (see README "Configuration").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path


def _env(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def _env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in {"1", "true", "yes", "on"}


def _env_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    value = value.lower()
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return value


def _env_coins(name: str, value: str) -> Decimal | None:
    """A relay budget in native coins (``0.05``), or ``unlimited`` (None)."""
    value = value.strip()
    if value.lower() == "unlimited":
        return None
    try:
        coins = Decimal(value)
    except ArithmeticError:
        coins = Decimal("NaN")
    if not coins.is_finite() or coins < 0:
        raise ValueError(f"{name}: {value!r} is not an amount of native coins (like 0.05) or 'unlimited'")
    return coins


def _env_budgets(name: str, value: str) -> tuple[tuple[str, Decimal | None], ...]:
    """``network=amount`` pairs, comma-separated (``eip155:1=0.5,eip155:8453=0.01``)."""
    pairs = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        network, sep, amount = item.rpartition("=")
        if not sep or not network.strip():
            raise ValueError(f"{name}: {item!r} is not <CAIP-2 network id>=<amount>")
        pairs.append((network.strip(), _env_coins(name, amount)))
    return tuple(pairs)


# SECRET_KEY's default: fine for local development, never for a dashboard others can reach.
DEVELOPMENT_SECRET_KEY = "dev-only-insecure-secret-key"


# The most settlement threads one relayer process runs (the RPC clients keep this many connections per chain).
MAX_RELAYER_THREADS = 128


def var_dir() -> Path:
    """Where the local stack keeps its SQLite file, Redis socket and devnet state."""
    path = Path(_env("PAYINTENT_VAR_DIR", "var")).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_database_url() -> str:
    return f"sqlite:///{var_dir() / 'payintent.db'}"


@dataclass(frozen=True)
class Settings:
    database_url: str
    redis_url: str | None
    chains_file: str | None
    checkout_host: str
    secret_key: str
    max_amount_usdc: Decimal
    log_level: str
    webhook_allow_private_targets: bool
    pay_wait_seconds: float = 30.0
    relayer_queue: str = "relayer"
    # The networks this relayer settles (RELAYER_NETWORKS, comma-separated CAIP-2 ids); empty: every
    # network it holds keys for. One relayer per chain is one relayer per network listed here.
    relayer_networks: tuple[str, ...] = ()
    # Settlements one relayer process runs at once (RELAYER_THREADS, ``payintent relayer --threads``): each mostly
    # waits for the chain, so their waits overlap; the relayer's database pool and RPC sessions follow it.
    relayer_threads: int = 32
    # RELAYER_STATE_DIR: the relayer processes' identity slots (backend/rails/evm/identity.py); None: the default.
    relayer_state_dir: str | None = None
    # Parallel webhook senders per worker process (a slow receiver holds one of them, not the queue).
    webhook_concurrency: int = 8
    # Attempts of one merchant in flight at once across all workers: keep it below webhook_concurrency,
    # so one merchant's slow or dead endpoints never hold every sender (docs/webhooks.md).
    webhook_max_in_flight_per_merchant: int = 2
    # Name resolution's share of the webhook deadline; a host not resolved in time fails the attempt.
    webhook_dns_timeout_seconds: float = 5.0
    # The spec's response deadline; not read from the environment (tests shorten it).
    webhook_timeout_seconds: float = 10.0
    # Rate limits per minute (0: off): each API key, each client IP on the keyed API, and failed
    # authentications per client IP (answered 429 instead of 401 past the limit).
    api_requests_per_minute_per_key: int = 1200
    api_requests_per_minute_per_ip: int = 2400
    api_auth_failures_per_minute: int = 30
    # Reverse proxies in front of the API that set X-Forwarded-For (0: use the peer address as is).
    trusted_proxy_hops: int = 0
    # The built checkout page (make install runs `npm run build` in checkout-ui/).
    checkout_dist_dir: str = str(Path(__file__).resolve().parents[1] / "checkout-ui" / "dist")
    # "json" (one object per line; the default) or "text" (what `payintent dev` uses).
    log_format: str = "json"
    # The bearer token /metrics requires; unset, /metrics answers 404 (docs/observability.md).
    metrics_token: str | None = None
    # True when DATABASE_URL is unset and database_url is the SQLite file under PAYINTENT_VAR_DIR (local
    # development and tests; the CLI upgrades it for you, and serve, worker and relayer warn about it).
    default_database: bool = False
    # What the relay may spend on one merchant's payments on one network over a rolling window
    # (backend.relaybudget), in that network's native coins (ETH, SOL, ...); None: unlimited.
    # RELAY_BUDGETS sets single networks; the others take the default of their kind.
    relay_budget_window_seconds: int = 86_400
    relay_budget_evm: Decimal | None = Decimal("0.05")
    relay_budget_solana: Decimal | None = Decimal("0.05")
    relay_budgets: tuple[tuple[str, Decimal | None], ...] = ()
    # Settlements one merchant may have open (claimed, not finished) on one network; more are refused
    # 429 TOO_MANY_OPEN_SETTLEMENTS (0: no cap).
    max_open_settlements: int = 20
    # Settlements one payer address may have open at once, over every merchant and network; more are
    # refused 429 PAYER_TOO_MANY_OPEN_PAYMENTS (0: no cap): one payer cannot hold many intents at once.
    max_open_settlements_per_payer: int = 5
    # Whether anyone may create a merchant account on the dashboard ("open") or only the operator, with
    # `payintent merchant create` ("closed"): what a public deployment should set (docs/deploy.md).
    dashboard_signup: str = "open"
    # Sign-up forms that reach the account check, per client address per hour (0: off).
    dashboard_signups_per_hour: int = 10
    # The reconciler's eth_getLogs searches at most this many blocks per call (RPC providers refuse wider ranges;
    # a refusal that names the range halves it, see evm.is_range_limit): RECONCILE_LOG_BLOCK_RANGE.
    reconcile_log_block_range: int = 2000
    # The time one reconcile pass gives each chain; the rest of a slow or unreachable chain's settlements wait for
    # the next pass, and the other chains go on (RECONCILE_CHAIN_SECONDS).
    reconcile_chain_seconds: float = 20.0
    # Failed dashboard log-ins per minute from every address and for every email together, browsers with a
    # device cookie for the account excepted; past it, other log-ins wait for the next minute (0: off). It
    # bounds a password spray (one common password tried on many accounts from many addresses).
    dashboard_login_failures_per_minute: int = 60
    # Failed log-ins from one client address (an IPv4 address, an IPv6 /64) per 15 minutes, over every email,
    # checked before the service-wide budget above: one address cannot spend that budget alone (0: off).
    dashboard_login_failures_per_address: int = 10
    # Password checks (log-ins, successful ones too, and sign-up forms that reach argon2) per client address per
    # minute; past it 429 with Retry-After, before any hash (0: off).
    dashboard_login_attempts_per_minute: int = 30
    # Password hashes (argon2: log-in, sign-up) running at once on this machine (0: one per core), shared by
    # the processes using the same slots directory (default: a per-user temporary one); a request that
    # finds no slot within the wait is answered 503 SERVER_BUSY (backend/passwords.py).
    login_hash_concurrency: int = 0
    login_hash_wait_seconds: float = 2.0
    login_hash_slots_dir: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Settings:
        # The var dir is only touched (created) when DATABASE_URL is unset: a production process may run in
        # a working directory it cannot write to.
        database_url = _env("DATABASE_URL", "")
        return cls(
            database_url=database_url or default_database_url(),
            default_database=not database_url,
            redis_url=_env("REDIS_URL", "") or None,
            chains_file=_env("CHAINS_FILE", "") or None,
            checkout_host=_env("CHECKOUT_HOST", "http://127.0.0.1:8000").rstrip("/"),
            secret_key=_env("SECRET_KEY", DEVELOPMENT_SECRET_KEY),
            max_amount_usdc=Decimal(_env("MAX_AMOUNT_USDC", "1000000")),
            log_level=_env("LOG_LEVEL", "INFO").upper(),
            webhook_allow_private_targets=_env_bool("WEBHOOK_ALLOW_PRIVATE_TARGETS"),
            pay_wait_seconds=float(_env("PAY_WAIT_SECONDS", "30")),
            relayer_queue=_env("RELAYER_QUEUE", "relayer"),
            relayer_networks=tuple(n.strip() for n in _env("RELAYER_NETWORKS", "").split(",") if n.strip()),
            relayer_threads=min(MAX_RELAYER_THREADS, max(1, int(_env("RELAYER_THREADS", "32")))),
            relayer_state_dir=_env("RELAYER_STATE_DIR", "") or None,
            webhook_concurrency=max(1, int(_env("WEBHOOK_CONCURRENCY", "8"))),
            webhook_max_in_flight_per_merchant=max(1, int(_env("WEBHOOK_MAX_IN_FLIGHT_PER_MERCHANT", "2"))),
            webhook_dns_timeout_seconds=min(10.0, max(0.1, float(_env("WEBHOOK_DNS_TIMEOUT_SECONDS", "5")))),
            checkout_dist_dir=_env("CHECKOUT_DIST_DIR", "") or cls.checkout_dist_dir,
            api_requests_per_minute_per_key=int(_env("API_RATE_LIMIT_PER_KEY", "1200")),
            api_requests_per_minute_per_ip=int(_env("API_RATE_LIMIT_PER_IP", "2400")),
            api_auth_failures_per_minute=int(_env("API_AUTH_FAILURES_PER_MINUTE", "30")),
            trusted_proxy_hops=int(_env("TRUSTED_PROXY_HOPS", "0")),
            log_format=_env("LOG_FORMAT", "json").lower(),
            metrics_token=_env("METRICS_TOKEN", "") or None,
            relay_budget_window_seconds=max(60, int(_env("RELAY_BUDGET_WINDOW_SECONDS", "86400"))),
            relay_budget_evm=_env_coins("RELAY_BUDGET_EVM", _env("RELAY_BUDGET_EVM", "0.05")),
            relay_budget_solana=_env_coins("RELAY_BUDGET_SOLANA", _env("RELAY_BUDGET_SOLANA", "0.05")),
            relay_budgets=_env_budgets("RELAY_BUDGETS", _env("RELAY_BUDGETS", "")),
            max_open_settlements=max(0, int(_env("MAX_OPEN_SETTLEMENTS", "20"))),
            max_open_settlements_per_payer=max(0, int(_env("MAX_OPEN_SETTLEMENTS_PER_PAYER", "5"))),
            dashboard_signup=_env_choice("DASHBOARD_SIGNUP", _env("DASHBOARD_SIGNUP", "open"), ("open", "closed")),
            dashboard_signups_per_hour=int(_env("DASHBOARD_SIGNUPS_PER_HOUR", "10")),
            reconcile_log_block_range=max(1, int(_env("RECONCILE_LOG_BLOCK_RANGE", "2000"))),
            reconcile_chain_seconds=max(1.0, float(_env("RECONCILE_CHAIN_SECONDS", "20"))),
            dashboard_login_failures_per_minute=max(0, int(_env("DASHBOARD_LOGIN_FAILURES_PER_MINUTE", "60"))),
            dashboard_login_failures_per_address=max(0, int(_env("DASHBOARD_LOGIN_FAILURES_PER_ADDRESS", "10"))),
            dashboard_login_attempts_per_minute=max(0, int(_env("DASHBOARD_LOGIN_ATTEMPTS_PER_MINUTE", "30"))),
            login_hash_concurrency=max(0, int(_env("LOGIN_HASH_CONCURRENCY", "0"))),
            login_hash_wait_seconds=min(30.0, max(0.0, float(_env("LOGIN_HASH_WAIT_SECONDS", "2")))),
            login_hash_slots_dir=_env("LOGIN_HASH_SLOTS_DIR", "") or None,
        )
