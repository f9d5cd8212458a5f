"""The environment of the service processes the harness starts (``payintent serve|worker|relayer``)."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAYINTENT = str(Path(sys.executable).with_name("payintent"))
SERVICE_VARS = ("DATABASE_URL", "REDIS_URL", "CHAINS_FILE")  # what a harness user chooses for the service
RELAY_KEY_VARS = ("RELAY_KEYS", "RELAY_KEYS_FILE")


def service_env(workdir: Path, drop: tuple[str, ...] = (), **values: str) -> dict[str, str]:
    """The environment of a service process: this one's without SERVICE_VARS and `drop`, with quiet logs,
    unbuffered output, a var dir under `workdir`, and `values`.

    Rate limits, relay budgets and the cap on a merchant's open settlements are off: one merchant pays
    thousands of times, beyond a day's budget, many at once."""
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_VARS and k not in drop}
    env.update(LOG_LEVEL="WARNING", PAYINTENT_VAR_DIR=str(workdir / "var"), PYTHONUNBUFFERED="1",
               SECRET_KEY=secrets.token_hex(32), API_RATE_LIMIT_PER_KEY="0", API_RATE_LIMIT_PER_IP="0",
               RELAY_BUDGET_EVM="unlimited", RELAY_BUDGET_SOLANA="unlimited", MAX_OPEN_SETTLEMENTS="0",
               MAX_OPEN_SETTLEMENTS_PER_PAYER="0",
               **values)  # fmt: skip
    return env


def local_secret(workdir: Path, name: str) -> str:
    """A random secret for this var dir, made once (SECRET_KEY: dashboard sessions survive restarts)."""
    path = workdir / name
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    return path.read_text().strip()
