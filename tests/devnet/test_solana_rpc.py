"""The local Solana RPC (``python -m devnet.solana_rpc``) as a client sees it: a real server process.

Clients are ``solana.rpc.async_api.AsyncClient`` (what the service uses) and plain JSON-RPC over
HTTP; transactions are real SPL Token transfers executed by LiteSVM.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests
from solana.rpc.async_api import AsyncClient
from solana.rpc.core import RPCException
from solana.rpc.models import TxOpts
from solders.compute_budget import set_compute_unit_limit, set_compute_unit_price
from solders.hash import Hash
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import Message, MessageV0
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import VersionedTransaction
from solders.transaction_status import TransactionConfirmationStatus
from spl.memo.constants import MEMO_PROGRAM_ID
from spl.memo.instructions import create_memo
from spl.memo.models import MemoParams
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import (
    create_idempotent_associated_token_account,
    get_associated_token_address,
    transfer_checked,
)
from spl.token.models import TransferCheckedParams

from devnet import anvil, solana_process
from devnet.solana_ledger import Ledger
from devnet.solana_network import DEVNET_GENESIS_HASH, is_local_genesis
from devnet.solana_setup import setup_document
from tests.conftest import free_port

SOL = 10**9
USDC = 10**6
BUYER_USDC = 10_000 * USDC
T = TypeVar("T")


@dataclass
class Node:
    url: str
    pid: int
    mint: Keypair
    authority: Keypair
    relay: Keypair
    buyers: list[Keypair]

    def call(self, method: str, params: list[Any] | None = None) -> dict[str, Any]:
        """The whole JSON-RPC response document."""
        body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params or []}
        return requests.post(self.url, json=body, timeout=10).json()

    def ata(self, owner: Pubkey) -> Pubkey:
        return get_associated_token_address(owner, self.mint.pubkey())


def _start(tmp: Path, *, slot_ms: int | None = None) -> tuple[Node, Callable[[], None]]:
    mint, authority, relay = Keypair(), Keypair(), Keypair()
    buyers = [Keypair() for _ in range(3)]
    accounts = [(str(relay.pubkey()), 100 * SOL, 0)] + [(str(b.pubkey()), 0, BUYER_USDC) for b in buyers]
    setup = tmp / "setup.json"
    setup.write_text(json.dumps(setup_document(mint, authority, accounts)))
    port = free_port()
    log = tmp / "solana-rpc.log"
    spawned = solana_process.spawn(port=port, setup_file=setup, log_file=log, cwd=tmp, slot_ms=slot_ms)
    url = f"http://127.0.0.1:{port}"
    try:
        solana_process.wait_ready(url, spawned.pid, str(mint.pubkey()), log)
    except BaseException:
        anvil.stop([spawned.pid])
        raise
    return Node(url, spawned.pid, mint, authority, relay, buyers), lambda: anvil.stop([spawned.pid])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started, stop = _start(tmp_path_factory.mktemp("solana"))
    try:
        yield started
    finally:
        stop()


def run(node: Node, use: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> T:
    async def main() -> T:
        async with AsyncClient(node.url, timeout=10) as client:
            return await use(client)

    return asyncio.run(main())


def _message(instructions: list[Instruction], payer: Pubkey, blockhash: Hash) -> Message:
    return Message.new_with_blockhash(instructions, payer, blockhash)


def _transfer(node: Node, buyer: Keypair, to_owner: Pubkey, amount: int) -> list[Instruction]:
    """What the service asks a buyer to sign: compute budget, one TransferChecked, a memo."""
    return [
        set_compute_unit_limit(40_000),
        set_compute_unit_price(1_000),
        transfer_checked(
            TransferCheckedParams(
                program_id=TOKEN_PROGRAM_ID,
                source=node.ata(buyer.pubkey()),
                mint=node.mint.pubkey(),
                dest=node.ata(to_owner),
                owner=buyer.pubkey(),
                amount=amount,
                decimals=6,
            )
        ),
        create_memo(MemoParams(program_id=MEMO_PROGRAM_ID, signer=buyer.pubkey(), message=b"pi_test_intent")),
    ]


def _merchant_with_token_account(node: Node) -> Pubkey:
    """A fresh merchant wallet whose token account the relay creates (as the service does)."""
    merchant = Keypair().pubkey()

    async def create(client: AsyncClient) -> None:
        blockhash = (await client.get_latest_blockhash()).value.blockhash
        ix = create_idempotent_associated_token_account(node.relay.pubkey(), merchant, node.mint.pubkey())
        await client.send_transaction(
            VersionedTransaction(_message([ix], node.relay.pubkey(), blockhash), [node.relay])
        )

    run(node, create)
    return merchant


def _usdc(node: Node, owner: Pubkey) -> int:
    return int(node.call("getTokenAccountBalance", [str(node.ata(owner))])["result"]["value"]["amount"])


def _lamports(node: Node, address: Pubkey) -> int:
    return node.call("getBalance", [str(address)])["result"]["value"]


# --- identity and set-up ----------------------------------------------------------------------------------


def test_each_ledger_is_a_chain_of_its_own() -> None:
    """A ledger started again (the devnet under a kept var/) answers another genesis hash, as a fresh validator
    ledger does, so the service sees a new chain; the first 32 characters stay Solana devnet's (its CAIP-2 id)."""
    hashes = {Ledger().genesis_hash for _ in range(3)}
    assert len(hashes) == 3
    for genesis in hashes:
        assert is_local_genesis(genesis) and genesis[:32] == DEVNET_GENESIS_HASH[:32]
        assert len(bytes(Pubkey.from_string(genesis))) == 32 and str(Pubkey.from_string(genesis)) == genesis
    assert not is_local_genesis(DEVNET_GENESIS_HASH[:32] + "1") and not is_local_genesis(None)


def test_it_answers_as_solana_devnet_and_makes_a_slot_every_400_ms(node: Node) -> None:
    genesis = node.call("getGenesisHash")["result"]
    assert genesis[:32] == DEVNET_GENESIS_HASH[:32] and is_local_genesis(genesis)  # Solana devnet's CAIP-2 id
    assert node.call("getGenesisHash")["result"] == genesis  # one ledger, one chain
    assert node.call("getHealth")["result"] == "ok"
    assert requests.get(f"{node.url}/health", timeout=5).text == "ok"
    version = run(node, lambda c: c.get_version())
    assert version.value.solana_core
    first = node.call("getSlot")["result"]
    time.sleep(1.0)
    assert 1 <= node.call("getSlot")["result"] - first <= 4
    latest = node.call("getLatestBlockhash")["result"]
    height = node.call("getBlockHeight")["result"]
    assert latest["context"]["slot"] >= 1
    assert height <= latest["value"]["lastValidBlockHeight"] <= height + 150


def test_setup_made_a_six_decimal_mint_and_funded_the_buyers_and_the_relay(node: Node) -> None:
    mint = node.call("getAccountInfo", [str(node.mint.pubkey()), {"encoding": "jsonParsed"}])["result"]["value"]
    assert mint["owner"] == str(TOKEN_PROGRAM_ID)
    info = mint["data"]["parsed"]["info"]
    assert (info["decimals"], info["mintAuthority"], info["freezeAuthority"]) == (6, str(node.authority.pubkey()), None)
    assert int(info["supply"]) >= 3 * BUYER_USDC
    for buyer in node.buyers:
        balance = run(node, lambda c, b=buyer: c.get_token_account_balance(node.ata(b.pubkey())))
        assert balance.value.amount == str(BUYER_USDC) and balance.value.decimals == 6
        assert balance.value.ui_amount_string == "10000"
    assert run(node, lambda c: c.get_balance(node.relay.pubkey())).value == 100 * SOL
    raw = run(node, lambda c: c.get_account_info(node.ata(node.buyers[0].pubkey())))
    assert raw.value.owner == TOKEN_PROGRAM_ID and len(raw.value.data) == 165


# --- a payment as the service makes it ----------------------------------------------------------------------


def test_transfer_checked_with_a_separate_fee_payer_moves_exactly_the_amount(node: Node) -> None:
    buyer = node.buyers[0]
    merchant = _merchant_with_token_account(node)
    buyer_before, relay_before = _usdc(node, buyer.pubkey()), _lamports(node, node.relay.pubkey())

    async def pay(client: AsyncClient) -> Signature:
        blockhash = (await client.get_latest_blockhash()).value.blockhash
        message = _message(_transfer(node, buyer, merchant, 1_500_000), node.relay.pubkey(), blockhash)
        tx = VersionedTransaction(message, [node.relay, buyer])
        return (await client.send_transaction(tx)).value

    signature = run(node, pay)
    assert _usdc(node, merchant) == 1_500_000
    assert buyer_before - _usdc(node, buyer.pubkey()) == 1_500_000
    assert _lamports(node, buyer.pubkey()) == 0  # the relay paid the fee
    fee = relay_before - _lamports(node, node.relay.pubkey())
    assert fee == 10_000 + 40  # two signatures + 1,000 micro-lamports x 40,000 units

    status = run(node, lambda c: c.get_signature_statuses([signature], search_transaction_history=True)).value[0]
    assert status is not None and status.err is None
    assert status.confirmation_status == TransactionConfirmationStatus.Finalized
    found = run(node, lambda c: c.get_transaction(signature, max_supported_transaction_version=0)).value
    assert found is not None and found.block_time is not None and found.slot == status.slot
    meta = found.transaction.meta
    assert meta.err is None and meta.fee == fee
    assert any("Memo (len 14)" in line for line in meta.log_messages)
    amounts = {(b.owner, b.ui_token_amount.amount) for b in [*meta.pre_token_balances, *meta.post_token_balances]}
    assert (merchant, "1500000") in amounts and (buyer.pubkey(), str(buyer_before - 1_500_000)) in amounts
    raw = node.call("getTransaction", [str(signature), {"encoding": "json"}])["result"]
    assert raw["transaction"]["message"]["accountKeys"][0] == str(node.relay.pubkey())
    assert raw["transaction"]["signatures"][0] == str(signature)
    assert raw["meta"]["status"] == {"Ok": None} and "version" not in raw


def test_a_v0_transaction_needs_max_supported_transaction_version_to_be_read(node: Node) -> None:
    buyer = node.buyers[1]
    merchant = _merchant_with_token_account(node)

    async def pay(client: AsyncClient) -> Signature:
        blockhash = (await client.get_latest_blockhash()).value.blockhash
        message = MessageV0.try_compile(node.relay.pubkey(), _transfer(node, buyer, merchant, 250_000), [], blockhash)
        return (await client.send_transaction(VersionedTransaction(message, [node.relay, buyer]))).value

    signature = run(node, pay)
    assert _usdc(node, merchant) == 250_000
    refused = node.call("getTransaction", [str(signature), {"encoding": "json"}])
    assert refused["error"]["code"] == -32015
    found = node.call("getTransaction", [str(signature), {"encoding": "json", "maxSupportedTransactionVersion": 0}])
    assert found["result"]["version"] == 0
    assert found["result"]["transaction"]["message"]["addressTableLookups"] == []


# --- what the node refuses ---------------------------------------------------------------------------------------


def test_a_stale_blockhash_is_refused_after_devnet_expire_blockhashes(node: Node) -> None:
    buyer = node.buyers[2]
    merchant = _merchant_with_token_account(node)
    old = run(node, lambda c: c.get_latest_blockhash()).value
    tx = VersionedTransaction(
        _message(_transfer(node, buyer, merchant, 1), node.relay.pubkey(), old.blockhash), [node.relay, buyer]
    )
    fresh = node.call("devnet_expireBlockhashes")["result"]
    assert fresh["blockhash"] != str(old.blockhash) and fresh["lastValidBlockHeight"] > old.last_valid_block_height

    assert node.call("isBlockhashValid", [str(old.blockhash)])["result"]["value"] is False
    with pytest.raises(RPCException) as refused:
        run(node, lambda c: c.send_transaction(tx))
    assert "Blockhash not found" in str(refused.value)
    sent = node.call("sendTransaction", [_b64(tx), {"encoding": "base64"}])
    assert sent["error"]["code"] == -32002 and sent["error"]["data"]["err"] == "BlockhashNotFound"
    simulated = node.call("simulateTransaction", [_b64(tx), {"encoding": "base64"}])["result"]["value"]
    assert simulated["err"] == "BlockhashNotFound"
    replaced = node.call("simulateTransaction", [_b64(tx), {"encoding": "base64", "replaceRecentBlockhash": True}])
    assert replaced["result"]["value"]["err"] is None
    assert (
        replaced["result"]["value"]["replacementBlockhash"]["blockhash"]
        == node.call("getLatestBlockhash")["result"]["value"]["blockhash"]
    )

    # Without preflight the node returns the signature, but the cluster drops the transaction.
    skipped = node.call("sendTransaction", [_b64(tx), {"encoding": "base64", "skipPreflight": True}])
    assert skipped["result"] == str(tx.signatures[0])
    statuses = node.call("getSignatureStatuses", [[skipped["result"]], {"searchTransactionHistory": True}])
    assert statuses["result"]["value"] == [None]
    assert _usdc(node, merchant) == 0


def test_a_blockhash_expires_150_blocks_after_it_was_made(tmp_path: Path) -> None:
    fast, stop = _start(tmp_path, slot_ms=5)
    try:
        latest = fast.call("getLatestBlockhash")["result"]["value"]
        assert fast.call("isBlockhashValid", [latest["blockhash"]])["result"]["value"] is True
        deadline = time.monotonic() + 20
        while fast.call("getBlockHeight")["result"] <= latest["lastValidBlockHeight"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert fast.call("isBlockhashValid", [latest["blockhash"]])["result"]["value"] is False
    finally:
        stop()


def test_a_duplicate_send_is_refused_and_moves_nothing(node: Node) -> None:
    buyer = node.buyers[0]
    merchant = _merchant_with_token_account(node)
    blockhash = run(node, lambda c: c.get_latest_blockhash()).value.blockhash
    tx = VersionedTransaction(
        _message(_transfer(node, buyer, merchant, 700_000), node.relay.pubkey(), blockhash), [node.relay, buyer]
    )
    first = node.call("sendTransaction", [_b64(tx), {"encoding": "base64"}])
    assert first["result"] == str(tx.signatures[0])
    again = node.call("sendTransaction", [_b64(tx), {"encoding": "base64"}])
    assert again["error"]["code"] == -32002
    assert again["error"]["message"] == "Transaction simulation failed: This transaction has already been processed"
    assert again["error"]["data"]["err"] == "AlreadyProcessed"
    skipped = node.call("sendTransaction", [_b64(tx), {"encoding": "base64", "skipPreflight": True}])
    assert skipped["result"] == str(tx.signatures[0])
    assert _usdc(node, merchant) == 700_000


def test_simulate_without_sig_verify_accepts_a_transaction_the_fee_payer_has_not_signed(node: Node) -> None:
    buyer = node.buyers[1]
    merchant = _merchant_with_token_account(node)
    blockhash = run(node, lambda c: c.get_latest_blockhash()).value.blockhash
    message = _message(_transfer(node, buyer, merchant, 300_000), node.relay.pubkey(), blockhash)
    # What the relay receives: the buyer's signature only; the fee payer's slot is still empty.
    tx = VersionedTransaction.populate(message, [Signature.default(), buyer.sign_message(bytes(message))])

    simulated = run(node, lambda c: c.simulate_transaction(tx, sig_verify=False)).value
    assert simulated.err is None and simulated.units_consumed > 0
    after = node.call(
        "simulateTransaction",
        [
            _b64(tx),
            {"encoding": "base64", "accounts": {"addresses": [str(node.ata(merchant))], "encoding": "jsonParsed"}},
        ],
    )["result"]["value"]["accounts"][0]
    assert after["data"]["parsed"]["info"]["tokenAmount"]["amount"] == "300000"  # what it would leave, not done
    assert f"Program {TOKEN_PROGRAM_ID} success" in simulated.logs
    with pytest.raises(RPCException, match="TransactionSignatureVerificationFailure"):
        run(node, lambda c: c.simulate_transaction(tx, sig_verify=True))
    refused = node.call("sendTransaction", [_b64(tx), {"encoding": "base64"}])
    assert refused["error"] == {"code": -32003, "message": "Transaction signature verification failure"}
    conflict = node.call(
        "simulateTransaction", [_b64(tx), {"encoding": "base64", "sigVerify": True, "replaceRecentBlockhash": True}]
    )
    assert conflict["error"]["code"] == -32602
    assert _usdc(node, merchant) == 0


def test_a_transfer_that_fails_in_the_program_is_refused_by_preflight_and_recorded_without_it(node: Node) -> None:
    buyer = node.buyers[2]
    merchant = _merchant_with_token_account(node)
    blockhash = run(node, lambda c: c.get_latest_blockhash()).value.blockhash
    too_much = _transfer(node, buyer, merchant, 10 * BUYER_USDC)
    tx = VersionedTransaction(_message(too_much, node.relay.pubkey(), blockhash), [node.relay, buyer])
    refused = node.call("sendTransaction", [_b64(tx), {"encoding": "base64"}])["error"]
    assert refused["code"] == -32002
    assert (
        refused["message"] == "Transaction simulation failed: Error processing Instruction 2: custom program error: 0x1"
    )
    assert refused["data"]["err"] == {"InstructionError": [2, {"Custom": 1}]}
    assert any("insufficient funds" in line for line in refused["data"]["logs"])

    relay_before = _lamports(node, node.relay.pubkey())
    signature = run(
        node, lambda c: c.send_raw_transaction(bytes(tx), TxOpts(skip_preflight=True, skip_confirmation=True))
    ).value
    status = node.call("getSignatureStatuses", [[str(signature)]])["result"]["value"][0]
    assert status["err"] == {"InstructionError": [2, {"Custom": 1}]} and status["status"] == {"Err": status["err"]}
    assert status["confirmationStatus"] == "finalized"
    assert relay_before - _lamports(node, node.relay.pubkey()) > 0  # included: the fee is charged
    assert _usdc(node, merchant) == 0


def test_request_airdrop_is_an_ordinary_transaction(node: Node) -> None:
    someone = Keypair().pubkey()
    signature = run(node, lambda c: c.request_airdrop(someone, 2 * SOL)).value
    assert _lamports(node, someone) == 2 * SOL
    again = run(node, lambda c: c.request_airdrop(someone, 2 * SOL)).value  # the same request at once: paid again
    assert again != signature and _lamports(node, someone) == 4 * SOL
    status = node.call("getSignatureStatuses", [[str(signature)]])["result"]["value"][0]
    assert status["confirmationStatus"] == "finalized"
    assert node.call("getMinimumBalanceForRentExemption", [165])["result"] == 2_039_280


# --- bad input ---------------------------------------------------------------------------------------------------


SYSTEM = "11111111111111111111111111111111"


def _request(method: str, params: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", -32700),
        (b"[]", -32600),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "getSlot"}', -32600),
        (_request("eth_chainId", []), -32601),
        (_request("getBalance", ["not-a-key"]), -32602),
        (_request("getBalance", {"a": 1}), -32602),
        (_request("sendTransaction", ["AAAA", {"encoding": "base64"}]), -32602),
        (_request("sendTransaction", ["0OIl"]), -32602),
        (_request("simulateTransaction", [7]), -32602),
        (_request("getSignatureStatuses", [["xyz"]]), -32602),
        (_request("getTokenAccountBalance", [SYSTEM]), -32602),
        (_request("requestAirdrop", [SYSTEM, 1e30]), -32602),
        (_request("getTransaction", [str(Signature.default()), {"maxSupportedTransactionVersion": "zero"}]), -32602),
    ],
)
def test_malformed_requests_get_json_rpc_errors_and_the_server_keeps_serving(
    node: Node, body: bytes, code: int
) -> None:
    response = requests.post(node.url, data=body, headers={"Content-Type": "application/json"}, timeout=5)
    assert response.status_code == 200
    document = response.json()
    error = document[0]["error"] if isinstance(document, list) else document["error"]
    assert error["code"] == code and error["message"]
    assert node.call("getHealth")["result"] == "ok"


def test_random_bytes_as_a_transaction_never_stop_the_server(node: Node) -> None:
    for size in (1, 64, 65, 200, 1232):
        for _ in range(20):
            data = base64.b64encode(b"\x01" + os.urandom(size)).decode()
            for method in ("sendTransaction", "simulateTransaction"):
                answer = node.call(method, [data, {"encoding": "base64", "skipPreflight": True}])
                assert "error" in answer or "result" in answer
    assert node.call("getHealth")["result"] == "ok"


def test_batches_oversized_bodies_and_cors(node: Node) -> None:
    batch = [{"jsonrpc": "2.0", "id": i, "method": m} for i, m in enumerate(["getSlot", "getHealth", "nope"])]
    answers = requests.post(node.url, json=batch, timeout=5).json()
    assert (
        [a["id"] for a in answers] == [0, 1, 2]
        and answers[1]["result"] == "ok"
        and answers[2]["error"]["code"] == -32601
    )
    assert requests.post(node.url, data=b"x" * 60_000, timeout=5).status_code == 413
    preflight = requests.options(
        node.url,
        headers={"Origin": "http://127.0.0.1:8000", "Access-Control-Request-Headers": "content-type"},
        timeout=5,
    )
    assert preflight.headers["Access-Control-Allow-Origin"] == "*"
    assert "content-type" in preflight.headers["Access-Control-Allow-Headers"]


def _b64(tx: VersionedTransaction) -> str:
    return base64.b64encode(bytes(tx)).decode()
