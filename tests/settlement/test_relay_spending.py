"""What the relay spends on a merchant's behalf, on the real devnet: balances checked on chain.

- Solana: a merchant cannot make the relay pay its USDC account's rent, however often it closes
  the account and re-registers its wallet; the buyer's own transaction opens a missing account,
  so a gone account (closed, or a devnet restarted under a kept var/) never blocks payments.
- A per-merchant budget refuses payments (429 RELAY_BUDGET_EXHAUSTED) once what the relay spent
  on that merchant on that network reaches it; the ledger matches the relay's balance exactly.
"""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from solders.hash import Hash
from solders.instruction import AccountMeta, Instruction
from solders.keypair import Keypair
from solders.message import MessageV0
from solders.pubkey import Pubkey
from solders.transaction import VersionedTransaction
from sqlalchemy import select

from backend.chains.solana import SolanaChain
from backend.extensions import db
from backend.merchants import services as merchants
from payintent import solana_tx as stx
from payintent.eip3009 import sign_authorization
from relayer.faults import CRASH_EXIT_CODE
from tests.conftest import create_merchant
from tests.observability.conftest import METRICS_TOKEN, parse, value
from tests.settlement.conftest import make_pay_app, stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_pay_solana import SOLANA, buyer, lamports, usdc
from tests.settlement.test_recovery import iso  # noqa: F401  (fixture)

CHECKOUT = "/api/v1/checkout/intents"
EVM = "eip155:84532"
OTHER_EVM = "eip155:11155111"


@pytest.fixture
def sol(devnet: Any) -> SolanaChain:
    return SolanaChain(devnet.info["solana"]["rpc_url"])


def public_client(app: Any) -> Any:
    """A client from its own address, so the public checkout's per-IP write limit is this test's alone."""
    client = app.test_client()
    client.environ_base["REMOTE_ADDR"] = (
        f"10.{secrets.randbelow(250)}.{secrets.randbelow(250)}.{secrets.randbelow(250)}"
    )
    return client


def prepare(client: Any, intent_id: str, payer: str) -> Any:
    """The public, unauthenticated call: anyone may name any payer; nothing is signed."""
    return client.post(f"{CHECKOUT}/{intent_id}/solana-transaction", json={"payer": payer, "network": SOLANA})


def public_pay(client: Any, intent_id: str, transaction: str) -> Any:
    signature = {"scheme": "exact", "network": SOLANA, "x402Version": 1, "payload": {"transaction": transaction}}
    return client.post(f"{CHECKOUT}/{intent_id}/pay", json={"payment_signature": signature})


def account_of(devnet: Any, owner: Pubkey) -> Pubkey:
    return stx.associated_token_address(owner, Pubkey.from_string(devnet.info["solana"]["usdc_mint"]))


def wait_for(condition: Any, seconds: float) -> bool:
    """Poll ``condition`` until true or ``seconds`` passed; returns its last value."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def send(sol: SolanaChain, fee_payer: Keypair, instructions: list[Instruction], signers: list[Keypair]) -> None:
    blockhash = Hash.from_string(sol.latest_blockhash().blockhash)
    sol.send(stx.encode(VersionedTransaction(MessageV0.try_compile(fee_payer.pubkey(), instructions, [], blockhash),
                                             signers)))  # fmt: skip


def close_account(sol: SolanaChain, devnet: Any, owner: Keypair, funder: Keypair) -> None:
    """The merchant empties its USDC account (back to ``funder``) and closes it, taking the rent back."""
    mint = Pubkey.from_string(devnet.info["solana"]["usdc_mint"])
    account = account_of(devnet, owner.pubkey())
    balance = sol.token_balance(str(account)) or 0
    instructions = []
    if balance:
        instructions.append(stx.transfer_checked(account, mint, account_of(devnet, funder.pubkey()), owner.pubkey(),
                                                 balance))  # fmt: skip
    closing = [AccountMeta(account, False, True), AccountMeta(owner.pubkey(), False, True),
               AccountMeta(owner.pubkey(), True, False)]  # fmt: skip
    instructions.append(Instruction(stx.TOKEN_PROGRAM, bytes([9]), closing))  # CloseAccount, rent to the owner
    message = MessageV0.try_compile(
        funder.pubkey(), instructions, [], Hash.from_string(sol.latest_blockhash().blockhash)
    )
    sol.send(stx.encode(VersionedTransaction(message, [funder, owner])))
    assert wait_for(lambda: not sol.account_exists(str(account)), 10)


def open_account(sol: SolanaChain, devnet: Any, owner: Keypair, funder: Keypair) -> None:
    """The merchant opens its USDC account itself, paying its rent (``funder`` sends it the SOL and pays the fee)."""
    from solders.system_program import TransferParams, transfer

    rent = sol.rent_exempt_minimum(stx.TOKEN_ACCOUNT_SIZE)
    mint = Pubkey.from_string(devnet.info["solana"]["usdc_mint"])
    instructions = [transfer(TransferParams(from_pubkey=funder.pubkey(), to_pubkey=owner.pubkey(), lamports=rent)),
                    stx.create_token_account(owner.pubkey(), owner.pubkey(), mint)]  # fmt: skip
    send(sol, funder, instructions, [funder, owner])
    assert wait_for(lambda: sol.token_balance(str(account_of(devnet, owner.pubkey()))) is not None, 10)


def pay_prepared(client: Any, intent: dict[str, Any], payer: Keypair) -> tuple[Any, dict[str, Any]]:
    """Prepare the transaction for ``payer``, sign it and pay: (the /pay answer, the prepared data)."""
    prepared = prepare(client, intent["intent_id"], str(payer.pubkey()))
    assert prepared.status_code == 200, prepared.data
    data = prepared.get_json()["data"]
    signed = stx.encode(stx.sign_as(stx.decode(data["transaction"]), payer))
    return public_pay(client, intent["intent_id"], signed), data


def opening_transaction(sol: SolanaChain, devnet: Any, intent: dict[str, Any], owner: Keypair, payer: Keypair) -> str:
    """A payment the buyer builds itself that opens the merchant's USDC account (what prepare gave before)."""
    tx = stx.build_payment(fee_payer=devnet.info["solana"]["fee_payer"], payer=str(payer.pubkey()),
                           mint=devnet.info["solana"]["usdc_mint"], pay_to=str(owner.pubkey()), amount_atomic=1_000_000,
                           intent_id=intent["intent_id"], recent_blockhash=sol.latest_blockhash().blockhash,
                           create_payee_account=True)  # fmt: skip
    return stx.encode(stx.sign_as(tx, payer))


def test_a_merchant_cannot_make_the_relay_or_its_buyers_pay_its_accounts_rent_again(pay_app, devnet, sol):
    """The attack, first review: trigger the account's creation with an unsigned request naming a funded
    payer, close the account (its rent goes to the merchant), remove and re-add the wallet, again: the relay
    paid about 0.002 SOL each round. Second review: with the buyer funding the account instead, a merchant
    closing it after every payment made every next buyer pay the rent again, and took it back each time.

    Now the relay pays each payment's fee and nothing else, the first buyer opens the account, and once a
    payment landed in it on this chain a closed account is opened by no buyer (409 PAYEE_ACCOUNT_CLOSED, from
    the service's transaction or one the buyer built) until the merchant opens it again itself."""
    client = public_client(pay_app)
    relay = devnet.info["solana"]["fee_payer"]
    owner = Keypair()
    shop = create_merchant(
        pay_app, f"rent-{str(owner.pubkey())[:8].lower()}@example.com", {SOLANA: str(owner.pubkey())}
    )
    account = str(account_of(devnet, owner.pubkey()))
    payer = buyer(devnet, 0)
    rent = int(sol.call("getMinimumBalanceForRentExemption", [165]))  # an SPL token account's: 2,039,280
    registry = pay_app.extensions["payintent.chains"]
    relay_before, owner_before = lamports(sol, relay), lamports(sol, str(owner.pubkey()))
    intent = create_intent(client, shop, 1)
    prepared = prepare(client, intent["intent_id"], str(payer.pubkey()))
    assert prepared.status_code == 200, prepared.data
    # Before the first fix the relayer opened the account (paying its rent) within a second or two of this call.
    assert not wait_for(lambda: sol.account_exists(account), 5), "the relay opened the account"
    assert lamports(sol, relay) == relay_before
    data = prepared.get_json()["data"]
    assert data["creates_payee_account"] is True and data["payer_pays_lamports"] == rent
    # The buyer signs and pays: its transaction opens the account, the buyer paying the rent.
    buyer_before = lamports(sol, str(payer.pubkey()))
    signed = stx.encode(stx.sign_as(stx.decode(data["transaction"]), payer))
    paid = public_pay(client, intent["intent_id"], signed)
    assert paid.status_code == 200, paid.data
    assert usdc(sol, devnet, str(owner.pubkey())) == 1_000_000
    fee = stx.transaction_fee(stx.decode(signed).message)
    assert fee == 2 * stx.LAMPORTS_PER_SIGNATURE + 80
    assert relay_before - lamports(sol, relay) == fee  # the relay paid the fee, and nothing else
    assert buyer_before - lamports(sol, str(payer.pubkey())) == rent
    # The merchant takes the USDC and the rent back, removes its wallet and adds it again.
    close_account(sol, devnet, owner, payer)
    assert lamports(sol, str(owner.pubkey())) - owner_before == rent  # the rent went to the merchant
    merchants.remove_wallet(shop.id, SOLANA)
    merchants.set_wallet(shop.id, SOLANA, str(owner.pubkey()), registry)
    # The next buyer is not asked for that rent again (before: prepared with the account opening, at its cost).
    buyer_before = lamports(sol, str(payer.pubkey()))
    second = create_intent(client, shop, 1)
    refused = prepare(client, second["intent_id"], str(payer.pubkey()))
    assert refused.status_code == 409, refused.data
    assert refused.get_json()["error"]["code"] == "PAYEE_ACCOUNT_CLOSED"
    refused = public_pay(client, second["intent_id"], opening_transaction(sol, devnet, second, owner, payer))
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "PAYEE_ACCOUNT_CLOSED"
    assert not sol.account_exists(account)
    assert lamports(sol, str(payer.pubkey())) == buyer_before and lamports(sol, relay) == relay_before - fee
    # The merchant opens it again (one command: docs/deploy.md), and is paid; the buyer pays no rent.
    open_account(sol, devnet, owner, buyer(devnet, 2))
    buyer_before = lamports(sol, str(payer.pubkey()))
    paid, data = pay_prepared(client, second, payer)
    assert paid.status_code == 200, paid.data
    assert data["creates_payee_account"] is False and data["payer_pays_lamports"] == 0
    assert lamports(sol, str(payer.pubkey())) == buyer_before and usdc(sol, devnet, str(owner.pubkey())) == 1_000_000
    # What the relay spent is on the merchant's budget: one fee per payment, nothing else.
    from backend.relaybudget.models import RelaySpend

    rows = db.session.execute(select(RelaySpend.kind, RelaySpend.amount_atomic).where(
        RelaySpend.merchant_id == shop.id)).all()  # fmt: skip
    assert sorted(rows) == [("fee", fee - 40), ("fee", fee)]
    assert relay_before - lamports(sol, relay) == 2 * fee - 40


def test_an_account_missing_on_a_new_chain_is_opened_again(pay_app, devnet, sol):
    """The opposite fault (first review): the devnet restarted under a kept var/ (its ledger is new, the
    database is not), and every payment to a merchant whose account the old ledger had was refused
    PAYEE_ACCOUNT_MISSING for ever. A ledger started again answers another genesis hash (as a fresh validator
    ledger does; devnet/solana_network.py), and what the service remembers is per genesis hash: on the new
    chain the first payment opens the account again, at that buyer's cost, as on any first payment."""
    from backend.settlement.models import PayeeAccount
    from devnet.solana_network import ledger_genesis_hash

    client = public_client(pay_app)
    owner = Keypair()
    shop = create_merchant(pay_app, f"gone-{str(owner.pubkey())[:8].lower()}@example.com",
                           {SOLANA: str(owner.pubkey())})  # fmt: skip
    payer = buyer(devnet, 1)
    # What the kept database remembers from the ledger before the restart: payments landed in this account.
    old = ledger_genesis_hash(b"the ledger before the restart")
    assert old != sol.genesis_hash() and old[:32] == sol.genesis_hash()[:32]  # the same network id
    db.session.add(PayeeAccount(network=SOLANA, owner=str(owner.pubkey()), mint=devnet.info["solana"]["usdc_mint"],
                                genesis_hash=old, created_at=datetime.now(UTC)))  # fmt: skip
    db.session.commit()
    paid, data = pay_prepared(client, create_intent(client, shop, 1), payer)
    assert data["creates_payee_account"] is True and paid.status_code == 200, paid.data
    assert usdc(sol, devnet, str(owner.pubkey())) == 1_000_000
    # On this chain too a payment has landed in it now: closed, it is the merchant's to open again.
    close_account(sol, devnet, owner, payer)
    refused = prepare(client, create_intent(client, shop, 1)["intent_id"], str(payer.pubkey()))
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "PAYEE_ACCOUNT_CLOSED"
    db.session.expire_all()
    remembered = db.session.scalars(select(PayeeAccount.genesis_hash).where(PayeeAccount.owner == str(owner.pubkey())))
    assert sorted(remembered) == sorted([old, sol.genesis_hash()])


def test_lamports_sent_to_the_accounts_address_do_not_block_payments(pay_app, devnet, sol):
    """Anyone can send SOL to the merchant's USDC account address before it exists: an account, but no
    token account. The payment still opens it (CreateIdempotent takes a pre-funded address) and pays."""
    from solders.system_program import TransferParams, transfer

    client = public_client(pay_app)
    owner = Keypair()
    shop = create_merchant(pay_app, f"dust-{str(owner.pubkey())[:8].lower()}@example.com",
                           {SOLANA: str(owner.pubkey())})  # fmt: skip
    griefer, payer = buyer(devnet, 2), buyer(devnet, 1)
    address = account_of(devnet, owner.pubkey())
    dust = int(sol.call("getMinimumBalanceForRentExemption", [0]))
    send(sol, griefer, [transfer(TransferParams(from_pubkey=griefer.pubkey(), to_pubkey=address, lamports=dust))],
         [griefer])  # fmt: skip
    assert wait_for(lambda: sol.account_exists(str(address)), 10)
    intent = create_intent(client, shop, 1)
    data = prepare(client, intent["intent_id"], str(payer.pubkey())).get_json()["data"]
    assert data["creates_payee_account"] is True
    paid = public_pay(client, intent["intent_id"], stx.encode(stx.sign_as(stx.decode(data["transaction"]), payer)))
    assert paid.status_code == 200, paid.data
    assert usdc(sol, devnet, str(owner.pubkey())) == 1_000_000


def test_a_transaction_prepared_before_the_account_was_closed_is_refused_before_sending(pay_app, devnet, sol):
    """A transaction that does not open the account, prepared while it existed: refused at /pay once the account
    is gone, before anything is sent. PAYEE_ACCOUNT_MISSING (fetch a new one, which opens it) while no payment of
    ours landed in it; PAYEE_ACCOUNT_CLOSED once one has (the merchant must open it again)."""
    client = public_client(pay_app)
    relay = devnet.info["solana"]["fee_payer"]
    owner = Keypair()
    shop = create_merchant(pay_app, f"closed-{str(owner.pubkey())[:8].lower()}@example.com",
                           {SOLANA: str(owner.pubkey())})  # fmt: skip
    payer = buyer(devnet, 1)
    open_account(sol, devnet, owner, buyer(devnet, 2))  # opened by the merchant: no payment landed in it yet
    for code in ("PAYEE_ACCOUNT_MISSING", "PAYEE_ACCOUNT_CLOSED"):
        intent = create_intent(client, shop, 1)
        data = prepare(client, intent["intent_id"], str(payer.pubkey())).get_json()["data"]
        assert data["creates_payee_account"] is False and data["payer_pays_lamports"] == 0
        stale = stx.encode(stx.sign_as(stx.decode(data["transaction"]), payer))
        close_account(sol, devnet, owner, payer)
        relay_before = lamports(sol, relay)
        refused = public_pay(client, intent["intent_id"], stale)
        assert refused.status_code == 409 and refused.get_json()["error"]["code"] == code, refused.data
        assert lamports(sol, relay) == relay_before  # nothing sent, no fee
        if code == "PAYEE_ACCOUNT_MISSING":
            paid, fresh = pay_prepared(client, intent, payer)  # the fresh one opens it (no payment landed in it)
            assert fresh["creates_payee_account"] is True and paid.status_code == 200, paid.data
            assert usdc(sol, devnet, str(owner.pubkey())) == 1_000_000
        else:
            again = prepare(client, intent["intent_id"], str(payer.pubkey()))
            assert again.status_code == 409 and again.get_json()["error"]["code"] == code


def test_the_relayer_does_not_send_an_opening_payment_for_an_account_closed_after_payments(iso, sol):  # noqa: F811
    """A payment that opens the account was claimed while no payment had landed in it; before the relayer
    co-signs it, one has (and the merchant closed the account again). The relayer does not send it (the buyer
    would pay the rent the merchant took back): the settlement fails PAYEE_ACCOUNT_CLOSED, the intent is
    payable again, and neither the relay nor the buyer pays anything."""
    from backend.settlement.models import PayeeAccount

    client = public_client(iso.app)
    devnet, relay = iso.devnet, iso.devnet.info["solana"]["fee_payer"]
    owner, payer = Keypair(), buyer(devnet, 0)
    shop = create_merchant(iso.app, f"race-{str(owner.pubkey())[:8].lower()}@example.com",
                           {SOLANA: str(owner.pubkey())})  # fmt: skip
    intent = create_intent(client, shop, 1)
    claimed, data = pay_prepared(client, intent, payer)
    assert data["creates_payee_account"] is True and claimed.status_code == 504, claimed.data  # no relayer yet
    # Meanwhile another payment landed in the account and the merchant closed it (as the relayer finds it).
    db.session.add(PayeeAccount(network=SOLANA, owner=str(owner.pubkey()), mint=devnet.info["solana"]["usdc_mint"],
                                genesis_hash=sol.genesis_hash(), created_at=datetime.now(UTC)))  # fmt: skip
    db.session.commit()
    relay_before, buyer_before = lamports(sol, relay), lamports(sol, str(payer.pubkey()))
    relayer = iso.relayer(RELAYER_NETWORKS=SOLANA)
    try:
        assert wait_for(lambda: iso.settlement(intent["intent_id"]).status == "failed", 60)
    finally:
        stop_process(relayer)
    settlement = iso.settlement(intent["intent_id"])
    assert settlement.failure_code == "PAYEE_ACCOUNT_CLOSED" and settlement.tx_hash is None
    assert iso.intent_row(intent["intent_id"]).settlement_id is None  # payable again
    assert lamports(sol, relay) == relay_before and lamports(sol, str(payer.pubkey())) == buyer_before
    assert not sol.account_exists(str(account_of(devnet, owner.pubkey())))


def test_a_payer_without_sol_for_the_rent_is_told_before_signing(pay_app, devnet, sol):
    client = public_client(pay_app)
    owner = Keypair()
    shop = create_merchant(pay_app, f"nosol-{str(owner.pubkey())[:8].lower()}@example.com",
                           {SOLANA: str(owner.pubkey())})  # fmt: skip
    # A payer holding USDC and no SOL at all (a funded buyer opens its account and sends it 5 USDC).
    poor, funder = Keypair(), buyer(devnet, 2)
    mint = Pubkey.from_string(devnet.info["solana"]["usdc_mint"])
    instructions = [stx.create_token_account(funder.pubkey(), poor.pubkey(), mint),
                    stx.transfer_checked(account_of(devnet, funder.pubkey()), mint, account_of(devnet, poor.pubkey()),
                                         funder.pubkey(), 5_000_000)]  # fmt: skip
    message = MessageV0.try_compile(
        funder.pubkey(), instructions, [], Hash.from_string(sol.latest_blockhash().blockhash)
    )
    sol.send(stx.encode(VersionedTransaction(message, [funder])))
    assert wait_for(lambda: usdc(sol, devnet, str(poor.pubkey())) == 5_000_000, 10)
    intent = create_intent(client, shop, 1)
    refused = prepare(client, intent["intent_id"], str(poor.pubkey()))
    assert refused.status_code == 402, refused.data
    error = refused.get_json()["error"]
    assert error["code"] == "PAYER_NEEDS_SOL" and error["rent_lamports"] == sol.rent_exempt_minimum(165)
    assert not sol.account_exists(str(account_of(devnet, owner.pubkey())))


# --- the budget -------------------------------------------------------------------------------------


@pytest.fixture
def budget_app(db_url: str, redis_server_url: str, devnet: Any, relayer: Any) -> Any:
    """The API with tiny relay budgets: each has room for one settlement at its most
    (``relaybudget.max_settlement_cost``), so one payment uses it up."""
    from dataclasses import replace

    from backend.relaybudget.services import max_settlement_cost

    application = make_pay_app(db_url, redis_server_url, devnet, metrics_token=METRICS_TOKEN)
    with application.app_context():
        settings = application.config["PAYINTENT_SETTINGS"]
        budgets = []
        for network in (EVM, OTHER_EVM, SOLANA):
            most = max_settlement_cost(devnet.chains.get(network), settings, "")  # a merchant with no charges yet
            budgets.append((network, Decimal(most).scaleb(-9 if network == SOLANA else -18)))
        application.config["PAYINTENT_SETTINGS"] = replace(settings, relay_budgets=tuple(budgets))
        yield application
        db.session.remove()
        db.engine.dispose()


def scrape(client: Any) -> Any:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 200
    return parse(response.get_data(as_text=True))


def relay_balances(devnet: Any, network: str) -> int:
    w3 = devnet.w3(network)
    return sum(int(w3.eth.get_balance(a)) for a in devnet.chains.get(network).relay_addresses)


def test_the_budget_refuses_evm_payments_once_the_relays_gas_reaches_it(budget_app, devnet):
    from web3 import Web3

    from backend.relaybudget.models import RelaySpend

    client = budget_app.test_client()
    payout = Web3.to_checksum_address("0x" + secrets.token_hex(20))
    shop = create_merchant(budget_app, f"gas-{payout[-8:].lower()}@example.com", {EVM: payout, OTHER_EVM: payout})
    refusals_before = value(scrape(client), "payintent_relay_budget_refusals_total", network=EVM, endpoint="pay") or 0
    relay_before = relay_balances(devnet, EVM)
    first = create_intent(client, shop, 1)
    response = pay(client, shop, first, EVM, sign_authorization(devnet.buyer(0).key, requirement(first, EVM)))
    assert response.status_code == 200, response.data
    tx_hash = response.get_json()["data"]["tx_hash"]
    receipt = devnet.w3(EVM).eth.get_transaction_receipt(tx_hash)
    gas = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    assert relay_before - relay_balances(devnet, EVM) == gas > 0  # what the relay paid, on chain ...
    (row,) = db.session.scalars(select(RelaySpend).where(RelaySpend.merchant_id == shop.id))
    assert (row.kind, row.amount_atomic, row.network, row.reference) == ("gas", gas, EVM, tx_hash)  # ... and recorded
    # The budget (one settlement at its most) is used up: the next payment is refused before anything is claimed
    # or sent.
    second = create_intent(client, shop, 1)
    buyer_before = devnet.balance(EVM, devnet.buyer(0).address)
    nonce_before = devnet.w3(EVM).eth.get_transaction_count(receipt["from"])
    refused = pay(client, shop, second, EVM, sign_authorization(devnet.buyer(0).key, requirement(second, EVM)))
    assert refused.status_code == 429, refused.data
    assert refused.get_json()["error"]["code"] == "RELAY_BUDGET_EXHAUSTED"
    assert 0 < int(refused.headers["Retry-After"]) <= 86_400
    assert devnet.balance(EVM, devnet.buyer(0).address) == buyer_before
    assert devnet.w3(EVM).eth.get_transaction_count(receipt["from"]) == nonce_before  # nothing sent
    assert relay_balances(devnet, EVM) == relay_before - gas
    read = client.get(f"/api/v1/x402/intents/{second['intent_id']}", headers=shop.headers).get_json()["data"]
    assert read["status"] == "pending" and read["tx_hash"] is None
    # Another network has a budget of its own.
    other = pay(
        client, shop, second, OTHER_EVM, sign_authorization(devnet.buyer(0).key, requirement(second, OTHER_EVM))
    )
    assert other.status_code == 200, other.data
    samples = scrape(client)
    assert value(samples, "payintent_relay_spent_total", network=EVM, kind="gas") == gas
    assert value(samples, "payintent_relay_budget_refusals_total", network=EVM, endpoint="pay") == refusals_before + 1


def test_the_budget_refuses_solana_payments_once_the_relays_fees_reach_it(budget_app, devnet, sol):
    client = public_client(budget_app)
    owner = Keypair()
    shop = create_merchant(budget_app, f"fees-{str(owner.pubkey())[:8].lower()}@example.com",
                           {SOLANA: str(owner.pubkey())})  # fmt: skip
    relay = devnet.info["solana"]["fee_payer"]
    payer = buyer(devnet, 0)
    first, second = create_intent(client, shop, 1), create_intent(client, shop, 1)
    # Both prepared while the budget is untouched; the first payment uses it up (room for one at its most).
    signed = {}
    for intent in (first, second):
        data = prepare(client, intent["intent_id"], str(payer.pubkey())).get_json()["data"]
        signed[intent["intent_id"]] = stx.encode(stx.sign_as(stx.decode(data["transaction"]), payer))
    relay_before = lamports(sol, relay)
    assert public_pay(client, first["intent_id"], signed[first["intent_id"]]).status_code == 200
    fee = relay_before - lamports(sol, relay)
    assert fee == stx.transaction_fee(stx.decode(signed[first["intent_id"]]).message) == 10_080
    buyer_usdc = usdc(sol, devnet, str(payer.pubkey()))
    refused = public_pay(client, second["intent_id"], signed[second["intent_id"]])
    assert refused.status_code == 429 and refused.get_json()["error"]["code"] == "RELAY_BUDGET_EXHAUSTED"
    # Refused before the buyer signs, too. That call is public and unsigned: anyone can make it refuse, so its
    # refusals are counted apart from /pay's (before, they inflated the one series operators watch for attacks).
    before = scrape(client)
    for _ in range(5):
        again = prepare(public_client(budget_app), second["intent_id"], str(Keypair().pubkey()))
        assert again.status_code == 429 and again.get_json()["error"]["code"] == "RELAY_BUDGET_EXHAUSTED"
    after = scrape(client)
    assert lamports(sol, relay) == relay_before - fee  # nothing more sent
    assert usdc(sol, devnet, str(payer.pubkey())) == buyer_usdc
    assert value(after, "payintent_relay_spent_total", network=SOLANA, kind="fee") == fee

    def refusals(samples: Any, endpoint: str) -> float:
        return value(samples, "payintent_relay_budget_refusals_total", network=SOLANA, endpoint=endpoint) or 0

    assert refusals(after, "prepare") == refusals(before, "prepare") + 5
    assert refusals(after, "pay") == refusals(before, "pay") >= 1


def test_the_gas_of_a_settlement_the_reconciler_finishes_is_charged_once(iso):  # noqa: F811
    """The relayer died right after broadcasting: the reconciler finishes the settlement and records the
    gas the relay paid, once however often it looks."""
    from backend.relaybudget.models import RelaySpend

    intent = create_intent(iso.client, iso.shop, 2)
    payload = sign_authorization(iso.devnet.buyer(2).key, requirement(intent, EVM))
    crashing = iso.relayer(fault="after-broadcast")
    try:
        assert pay(iso.client, iso.shop, intent, EVM, payload).status_code == 504
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    settlement = iso.settlement(intent["intent_id"])

    def charged() -> list[tuple[str, int, str]]:
        db.session.expire_all()
        query = select(RelaySpend.kind, RelaySpend.amount_atomic, RelaySpend.reference)
        return [tuple(row) for row in db.session.execute(query.where(RelaySpend.settlement_id == settlement.id))]

    assert charged() == []  # the relayer died before it could record anything
    assert iso.reconcile_later()["finished"] == 1
    assert iso.reconcile_later()["finished"] == 0
    receipt = iso.devnet.w3(EVM).eth.get_transaction_receipt(settlement.tx_hash)
    assert charged() == [("gas", receipt["gasUsed"] * receipt["effectiveGasPrice"], settlement.tx_hash)]
