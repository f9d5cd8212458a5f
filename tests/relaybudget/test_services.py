"""The relay budget: the ledger, the rolling window, the refusal and its metrics (both engines, a frozen clock)."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from backend.chains.registry import Network
from backend.config import Settings
from backend.errors import APIError
from backend.extensions import db
from backend.relaybudget import services as budget
from backend.relaybudget.models import FEE, GAS, RelaySpend
from tests.conftest import make_settings
from tests.observability.conftest import METRICS_TOKEN, parse, value

BASE = Network("eip155:84532", "Base Sepolia", "evm", None, "0x036CbD53842c5426634e7929541eC2318f3dCF7e")
ARC = replace(BASE, network="eip155:5042002", name="Arc Testnet", native_currency=("USDC", "USDC", 18))
SOLANA = Network("solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", "Solana Devnet", "solana", None,
                 "4zMMC9srt5Ri5X14GAgXhaHii3GnPAEERYPJgZJDncDU")  # fmt: skip


def settings(**overrides) -> Settings:
    return make_settings("sqlite://", **overrides)


def test_budgets_are_native_coins_per_network_kind_with_overrides():
    default = settings()
    assert budget.budget_atomic(BASE, default) == 5 * 10**16  # 0.05 ETH in wei
    assert budget.budget_atomic(SOLANA, default) == 5 * 10**7  # 0.05 SOL in lamports
    custom = settings(relay_budget_evm=Decimal("0.001"), relay_budgets=(("eip155:5042002", Decimal("2")),
                                                                       (SOLANA.network, None)))  # fmt: skip
    assert budget.budget_atomic(BASE, custom) == 10**15
    assert budget.budget_atomic(ARC, custom) == 2 * 10**18  # Arc pays gas in USDC with 18 decimals
    assert budget.budget_atomic(SOLANA, custom) is None  # unlimited


def test_budget_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("RELAY_BUDGET_EVM", "0.2")
    monkeypatch.setenv("RELAY_BUDGET_SOLANA", "unlimited")
    monkeypatch.setenv("RELAY_BUDGETS", "eip155:1=1.5, solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1=0.01")
    monkeypatch.setenv("RELAY_BUDGET_WINDOW_SECONDS", "3600")
    loaded = Settings.from_env()
    assert (loaded.relay_budget_evm, loaded.relay_budget_solana, loaded.relay_budget_window_seconds) == (
        Decimal("0.2"), None, 3600)  # fmt: skip
    assert loaded.relay_budgets == (("eip155:1", Decimal("1.5")), (SOLANA.network, Decimal("0.01")))
    for bad in ("eip155:1", "=1", "eip155:1=-1", "eip155:1=lots", "eip155:1=NaN"):
        monkeypatch.setenv("RELAY_BUDGETS", bad)
        with pytest.raises(ValueError, match="RELAY_BUDGETS"):
            Settings.from_env()


def test_gas_cost_is_gas_used_times_price_plus_any_l1_fee():
    assert budget.evm_gas_cost({"gasUsed": 60_000, "effectiveGasPrice": 2 * 10**9}) == 12 * 10**13
    assert budget.evm_gas_cost({"gasUsed": 60_000, "effectiveGasPrice": 10, "l1Fee": "0x64"}) == 600_100


def test_a_transaction_is_charged_once(app, merchant, clock):
    assert budget.charge(merchant.id, BASE.network, GAS, 1000, "0xabc")
    assert not budget.charge(merchant.id, BASE.network, GAS, 1000, "0xabc")  # the reconciler saw it too
    assert budget.charge(merchant.id, SOLANA.network, FEE, 1000, "0xabc")  # another network: another transaction
    assert not budget.charge(merchant.id, BASE.network, GAS, 0, "0xdef")
    with pytest.raises(ValueError):
        budget.charge(merchant.id, BASE.network, "tips", 1, "0x1")
    assert db.session.scalar(select(func.count()).select_from(RelaySpend)) == 2
    assert budget.spent(merchant.id, BASE.network, clock() - budget.window(settings())) == 1000


def test_a_used_up_budget_refuses_until_the_window_rolls_on(app, merchant, other_merchant, clock):
    limited = settings(relay_budget_evm=Decimal("0.000000000000001"))  # 1,000 wei
    budget.check(merchant.id, BASE, limited)
    budget.charge(merchant.id, BASE.network, GAS, 600, "0x1")
    clock.advance(hours=2)
    budget.charge(merchant.id, BASE.network, GAS, 600, "0x2")
    with pytest.raises(APIError) as refused:
        budget.check(merchant.id, BASE, limited)
    err = refused.value
    assert (err.http_status, err.code, err.extra["network"]) == (429, "RELAY_BUDGET_EXHAUSTED", BASE.network)
    # 1,200 spent: once the first 600 rolls out of the 24 h window (in 22 h), 600 < 1,000 again.
    assert err.headers["Retry-After"] == str(22 * 3600) == str(err.extra["retry_after"])
    budget.check(other_merchant.id, BASE, limited)  # per merchant
    budget.check(merchant.id, SOLANA, limited)  # per network
    budget.check(merchant.id, BASE, replace(limited, relay_budgets=((BASE.network, None),)))  # unlimited
    clock.advance(hours=22, seconds=1)
    budget.check(merchant.id, BASE, limited)


def test_spending_and_refusals_are_metrics(app, merchant, clock):
    app.config["PAYINTENT_SETTINGS"] = replace(app.config["PAYINTENT_SETTINGS"], metrics_token=METRICS_TOKEN)
    client = app.test_client()

    def scrape():
        response = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert response.status_code == 200
        return parse(response.get_data(as_text=True))

    refusals_before = value(scrape(), "payintent_relay_budget_refusals_total", network=BASE.network) or 0
    budget.charge(merchant.id, BASE.network, GAS, 7 * 10**13, "0x1")
    budget.charge(merchant.id, BASE.network, GAS, 10**13, "0x2")
    budget.charge(merchant.id, SOLANA.network, FEE, 10_040, "sig1")
    with pytest.raises(APIError):
        budget.check(merchant.id, BASE, settings(relay_budget_evm=Decimal("0.00001")))
    samples = scrape()
    assert value(samples, "payintent_relay_spent_total", network=BASE.network, kind="gas") == 8 * 10**13
    assert value(samples, "payintent_relay_spent_total", network=SOLANA.network, kind="fee") == 10_040
    assert value(samples, "payintent_relay_budget_refusals_total", network=BASE.network) == refusals_before + 1
