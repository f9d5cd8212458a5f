"""A stack's first data: the database migrated, a merchant with an API key and payout wallets (through the
``payintent`` CLI, as an operator would), and ``payintent dev``'s demo merchant (in-process)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from typing import Any

from harness.env import PAYINTENT, ROOT
from harness.errors import HarnessError

DEMO_EMAIL = "demo@payintent.local"
DEMO_PASSWORD = "demo-password"


def payintent(env: dict[str, str], *args: str) -> dict[str, Any]:
    """Run a `payintent` command to its end; returns the JSON of its last output line."""
    out = subprocess.run([PAYINTENT, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise HarnessError(f"payintent {' '.join(args[:2])} failed ({out.returncode}): {out.stdout} {out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]  # a JSON object by contract


def create_merchant(env: dict[str, str], email: str, password: str = "bench-password") -> dict[str, Any]:
    """Migrate the database of `env` and create one merchant; returns `payintent merchant create`'s answer
    (``merchant_id``, ``api_key``...)."""
    payintent(env, "db", "upgrade")
    return payintent(env, "merchant", "create", "--email", email, "--password", password)


def set_wallets(env: dict[str, str], merchant_id: str, networks: Iterable[str], address: str) -> None:
    """The merchant's payout address on each of ``networks`` (``payintent wallet set``)."""
    for network in networks:
        payintent(env, "wallet", "set", "--merchant", merchant_id, "--network", network, "--address", address)


def seed_demo_merchant(previous_wallets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Create (once) the demo merchant with a wallet on every configured network; issue a new key. In this
    process, with the app of this environment (``payintent dev``).

    Its payout wallets are accounts whose keys are returned under ``merchant_wallets`` ({network: {address,
    private_key}}), so that a developer can sign as the merchant (a refund). ``previous_wallets``: that map from
    the last start (var/demo.json); a network's wallet is kept when its address is still a valid one of its kind,
    so payments made before a restart stay signable; a network without one gets a new random account."""
    from sqlalchemy import select

    from backend import appstate
    from backend.app import create_app
    from backend.extensions import db
    from backend.merchants import services
    from backend.merchants.models import Merchant
    from backend.rails.registry import rail_for

    app = create_app()
    with app.app_context():
        registry = appstate.chains(app)
        merchant = db.session.scalar(select(Merchant).where(Merchant.email == DEMO_EMAIL))
        if merchant is None:
            merchant, issued = services.create_merchant(DEMO_EMAIL, DEMO_PASSWORD, "Demo Shop")
        else:
            issued = services.create_api_key(merchant.id)
        wallets: dict[str, dict[str, str]] = {}
        for network in registry:
            wallets[network.network] = _demo_wallet(rail_for(network), (previous_wallets or {}).get(network.network))
            # Verified: the dev stack made these keys itself (var/demo.json holds them), as a wallet's proof shows.
            services.set_wallet(merchant.id, network.network, wallets[network.network]["address"], registry,
                                verified=True)  # fmt: skip
        return {
            "merchant_id": merchant.id,
            "email": DEMO_EMAIL,
            "password": DEMO_PASSWORD,
            "api_key": issued.secret,
            "merchant_wallets": wallets,
        }


def _demo_wallet(rail: Any, previous: Any) -> dict[str, str]:
    """The previous start's wallet of a network if it is still a valid one of the rail's kind, else a new one."""
    from backend.chains.addresses import AddressError

    if isinstance(previous, dict) and isinstance(previous.get("private_key"), str):
        try:
            return {
                "address": rail.normalize_address(str(previous.get("address"))),
                "private_key": previous["private_key"],
            }
        except AddressError:
            pass
    address, private_key = rail.new_wallet()
    return {"address": address, "private_key": private_key}


def create_demo_intent(base_url: str, api_key: str) -> str:
    """A pending intent for ``payintent dev``'s checkout link (made through the API, like a merchant would)."""
    import requests

    response = requests.post(
        f"{base_url}/api/v1/x402/intents",
        json={"amount_usdc": 5, "description": "Demo order: pay me with a browser wallet"},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=10,
    )
    response.raise_for_status()
    return str(response.json()["data"]["checkout_url"])
