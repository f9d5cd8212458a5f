"""The EVM relay's nonce manager on a real Anvil with our TestUSDC: many transactions in flight per block, gaps found
and filled, returned nonces reused, replacements at the same nonce, restarts that neither reuse nor skip a nonce;
and the replacement fees rule."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from eth_account import Account
from eth_account.signers.local import LocalAccount
from redis import Redis
from web3 import Web3
from web3.contract import Contract
from web3.exceptions import TransactionNotFound

from backend.rails.evm.nonces import CANCEL_GAS, NonceManager, bumped, replacement_fees
from backend.rails.evm.relay import GAS_LIMIT
from tests.devnet.chain import ARTIFACT, CHAIN_ID, Anvil, running_anvil, send

NETWORK = f"eip155:{CHAIN_ID}"
GWEI = 10**9


@pytest.fixture(scope="module")
def anvil(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Anvil]:
    """An Anvil of this module alone: its tests stop its mining."""
    with running_anvil(tmp_path_factory, "anvil-nonces") as node:
        yield node


@pytest.fixture(scope="module")
def w3(anvil: Anvil) -> Web3:
    return Web3(Web3.HTTPProvider(anvil.url, request_kwargs={"timeout": 10}))


@pytest.fixture(scope="module")
def owner(w3: Web3) -> LocalAccount:
    account: LocalAccount = Account.create()
    w3.provider.make_request("anvil_setBalance", [account.address, hex(10**20)])
    return account


@pytest.fixture(scope="module")
def token(w3: Web3, owner: LocalAccount) -> Contract:
    artifact = json.loads(ARTIFACT.read_text())
    receipt = send(
        w3, owner, w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"]).constructor(owner.address)
    )
    assert receipt["status"] == 1
    return w3.eth.contract(address=receipt["contractAddress"], abi=artifact["abi"])


@pytest.fixture
def relay(w3: Web3, token: Contract, owner: LocalAccount) -> LocalAccount:
    """A fresh relay account (nonce 0) with ETH for gas and 1,000 TestUSDC to send."""
    account: LocalAccount = Account.create()
    w3.provider.make_request("anvil_setBalance", [account.address, hex(10**20)])
    assert send(w3, owner, token.functions.mint(account.address, 1_000 * 10**6))["status"] == 1
    return account


@pytest.fixture
def redis(redis_url: str) -> Redis:
    return Redis.from_url(redis_url)


@pytest.fixture
def no_mining(w3: Web3, relay: LocalAccount) -> Iterator[None]:
    """Anvil mines only when the test says so (``mine``), once the relay account is funded."""
    rpc(w3, "evm_setAutomine", [False])
    try:
        yield
    finally:
        rpc(w3, "evm_setAutomine", [True])


def rpc(w3: Web3, method: str, params: list[Any] | None = None) -> Any:
    answer = w3.provider.make_request(method, params or [])
    assert "error" not in answer, answer
    return answer.get("result")


def mine(w3: Web3) -> int:
    rpc(w3, "evm_mine")
    return int(w3.eth.block_number)


def manager(w3: Web3, relay: LocalAccount, redis: Redis) -> NonceManager:
    return NonceManager(w3, NETWORK, relay.address, CHAIN_ID, redis)


def market(w3: Web3) -> dict[str, int]:
    base = int(w3.eth.get_block("latest").get("baseFeePerGas") or 0)
    return {"maxPriorityFeePerGas": GWEI, "maxFeePerGas": 2 * base + GWEI}


def transfer(w3: Web3, token: Contract, relay: LocalAccount, to: str, amount: int, nonce: int,
             fees: dict[str, int] | None = None) -> tuple[str, bytes]:  # fmt: skip
    """A signed TestUSDC transfer from the relay at ``nonce`` (the relay transaction's gas limit): hash, raw."""
    tx = token.functions.transfer(to, amount).build_transaction(
        {"from": relay.address, "nonce": nonce, "gas": GAS_LIMIT, "chainId": CHAIN_ID, **(fees or market(w3))}
    )
    signed = relay.sign_transaction(tx)
    return "0x" + bytes(signed.hash).hex(), bytes(signed.raw_transaction)


def broadcast(w3: Web3, raw: bytes) -> None:
    w3.eth.send_raw_transaction(raw)


def balance(token: Contract, address: str) -> int:
    return int(token.functions.balanceOf(address).call())


def receipt(w3: Web3, tx_hash: str) -> Any:
    return w3.eth.get_transaction_receipt(tx_hash)


def test_ten_transactions_in_flight_from_one_account_are_mined_in_one_block(w3, token, relay, redis, no_mining):
    nonces = manager(w3, relay, redis)
    assert nonces.start(None) == []
    payee = Account.create().address
    hashes = []
    for _ in range(10):
        nonce = nonces.allocate()
        tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
        broadcast(w3, raw)
        nonces.sent(nonce, tx_hash)
        hashes.append(tx_hash)
    assert [tx.nonce for tx in nonces.in_flight()] == list(range(10))
    assert balance(token, payee) == 0  # all waiting in the pool
    block = mine(w3)
    assert [receipt(w3, h)["blockNumber"] for h in hashes] == [block] * 10
    assert all(receipt(w3, h)["status"] == 1 for h in hashes)
    assert balance(token, payee) == 10_000
    assert nonces.stuck(older_than=0) == []  # mined: nothing left in flight
    assert redis.get(nonces.hint_key) == f"9:{hashes[-1]}".encode()


def test_a_nonce_never_broadcast_is_a_gap_that_a_fresh_start_reports_and_a_cancel_fills(
    w3, token, relay, redis, no_mining
):
    first = manager(w3, relay, redis)
    first.start(None)
    payee = Account.create().address
    hashes = {}
    for _ in range(5):
        nonce = first.allocate()
        tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
        first.sent(nonce, tx_hash)  # recorded as sent ...
        if nonce != 2:  # ... but nonce 2 never reached the node (a crash in between)
            broadcast(w3, raw)
            hashes[nonce] = tx_hash
    mine(w3)
    assert balance(token, payee) == 2_000  # 0 and 1; 3 and 4 wait behind the missing 2
    assert w3.eth.get_transaction_count(relay.address, "pending") == 2
    with pytest.raises(TransactionNotFound):
        receipt(w3, hashes[3])

    restarted = manager(w3, relay, redis)
    gaps = restarted.start(recorded_max=4)
    assert gaps == [2, 3, 4]  # not counted by the chain: 2 is lost, 3 and 4 are queued in the node
    assert restarted.allocate() == 5  # never one of them
    restarted.returned(5)
    cancel = relay.sign_transaction(restarted.cancel_transaction(2, market(w3)))
    broadcast(w3, bytes(cancel.raw_transaction))
    block = mine(w3)
    cancelled = receipt(w3, "0x" + bytes(cancel.hash).hex())
    assert cancelled["status"] == 1 and cancelled["gasUsed"] == CANCEL_GAS
    assert receipt(w3, hashes[3])["blockNumber"] == receipt(w3, hashes[4])["blockNumber"] == block
    assert balance(token, payee) == 4_000  # every later transfer mined once the gap was filled
    assert w3.eth.get_transaction_count(relay.address, "latest") == 5
    tx = w3.eth.get_transaction("0x" + bytes(cancel.hash).hex())
    assert (tx["to"], tx["value"], tx["nonce"]) == (relay.address, 0, 2)


def test_a_returned_nonce_is_handed_out_again_and_leaves_no_gap(w3, token, relay, redis, no_mining):
    nonces = manager(w3, relay, redis)
    nonces.start(None)
    assert [nonces.allocate() for _ in range(3)] == [0, 1, 2]
    nonces.returned(1)  # its pre-send check failed: never broadcast
    assert nonces.holes() == [1]
    assert nonces.allocate() == 1
    assert nonces.allocate() == 3
    nonces.returned(3)  # the highest: the next fresh nonce just goes back
    assert (nonces.holes(), nonces.next_nonce) == ([], 3)
    with pytest.raises(ValueError):
        nonces.returned(3)  # not allocated any more
    payee = Account.create().address
    hashes = []
    for nonce in (2, 0, 1):  # sent out of order, as parallel senders do
        tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
        broadcast(w3, raw)
        nonces.sent(nonce, tx_hash)
        hashes.append(tx_hash)
    block = mine(w3)
    assert [receipt(w3, h)["blockNumber"] for h in hashes] == [block] * 3
    assert w3.eth.get_transaction_count(relay.address, "latest") == 3 == nonces.allocate()
    assert balance(token, payee) == 3_000
    assert redis.get(nonces.hint_key) == f"2:{hashes[0]}".encode()  # the highest sent, not the last
    assert manager(w3, relay, redis).start(None) == []


def test_a_replacement_at_the_same_nonce_is_mined_instead_of_the_original(w3, token, relay, redis, no_mining):
    nonces = manager(w3, relay, redis)
    nonces.start(None)
    payee = Account.create().address
    nonce = nonces.allocate()
    low = {"maxPriorityFeePerGas": GWEI, "maxFeePerGas": market(w3)["maxFeePerGas"]}
    original, raw = transfer(w3, token, relay, payee, 5_000, nonce, low)
    broadcast(w3, raw)
    nonces.sent(nonce, original)
    [late] = nonces.stuck(older_than=0)
    assert (late.nonce, late.tx_hash) == (nonce, original)
    fees = replacement_fees(low, market(w3), cap_wei_per_gas=None)
    assert fees is not None
    replacement, raw = transfer(w3, token, relay, payee, 5_000, nonce, fees)
    broadcast(w3, raw)
    nonces.sent(nonce, replacement)
    block = mine(w3)
    assert receipt(w3, replacement)["blockNumber"] == block and receipt(w3, replacement)["status"] == 1
    with pytest.raises(TransactionNotFound):
        receipt(w3, original)  # never mined: at one nonce, one transaction
    assert balance(token, payee) == 5_000  # one transfer
    assert balance(token, relay.address) == 1_000 * 10**6 - 5_000
    assert w3.eth.get_transaction(replacement)["maxPriorityFeePerGas"] == fees["maxPriorityFeePerGas"]


def test_a_restart_with_transactions_in_the_pool_starts_after_them_even_without_the_redis_hint(
    w3, token, relay, redis, no_mining
):
    payee = Account.create().address
    first = manager(w3, relay, redis)
    first.start(None)
    for _ in range(3):  # in the pool, not mined, when the relayer restarts
        nonce = first.allocate()
        tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
        broadcast(w3, raw)
        first.sent(nonce, tx_hash)
    second = manager(w3, relay, redis)
    assert second.start(None) == []
    nonce = second.allocate()
    assert nonce == 3
    tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
    broadcast(w3, raw)  # no "nonce too low", no replacement of one in the pool
    second.sent(nonce, tx_hash)

    # A settlement recorded nonce 4 (its relay_nonce) and the relayer died before the broadcast; Redis is lost too.
    assert second.allocate() == 4
    redis.flushdb()
    third = manager(w3, relay, redis)
    assert third.start(recorded_max=4) == [4]  # the chain counts 4 transactions; the database knows of a 5th
    assert third.allocate() == 5
    assert manager(w3, relay, redis).start(None) == []  # the chain alone would hand out 4 again
    cancel = relay.sign_transaction(third.cancel_transaction(4, market(w3)))
    broadcast(w3, bytes(cancel.raw_transaction))
    tx_hash, raw = transfer(w3, token, relay, payee, 1_000, 5)
    broadcast(w3, raw)
    third.sent(5, tx_hash)
    block = mine(w3)
    assert receipt(w3, tx_hash)["blockNumber"] == block
    assert w3.eth.get_transaction_count(relay.address, "latest") == 6
    assert balance(token, payee) == 5_000


def test_a_hint_whose_transaction_the_node_dropped_keeps_its_nonce_as_a_gap(w3, token, relay, redis, no_mining):
    nonces = manager(w3, relay, redis)
    nonces.start(None)
    payee = Account.create().address
    for _ in range(2):
        nonce = nonces.allocate()
        tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
        broadcast(w3, raw)
        nonces.sent(nonce, tx_hash)
    rpc(w3, "anvil_dropTransaction", [tx_hash])  # the node forgets nonce 1: it may still be mined elsewhere
    assert w3.eth.get_transaction_count(relay.address, "pending") == 1
    assert manager(w3, relay, redis).start(None) == [1]  # not handed out again: filled (or sent again) by the caller
    assert nonces.start(None) == [1] and nonces.in_flight() == []  # a start forgets what was in flight


def test_resync_after_nonce_too_low_moves_past_what_someone_else_sent(w3, token, relay, redis):
    nonces = manager(w3, relay, redis)
    nonces.start(None)
    payee = Account.create().address
    for nonce in range(2):  # another sender (an operator's wallet, a second relayer) uses the account
        broadcast(w3, transfer(w3, token, relay, payee, 1_000, nonce)[1])
    nonce = nonces.allocate()
    assert nonce == 0
    with pytest.raises(Exception, match=r"(?i)nonce too low"):
        broadcast(w3, transfer(w3, token, relay, payee, 1_000, nonce)[1])
    assert nonces.resync() == []
    assert nonces.allocate() == 2


def test_a_nonce_sent_without_allocate_is_never_handed_out_again(w3, token, relay, redis, no_mining):
    nonces = manager(w3, relay, redis)
    nonces.start(None)
    assert [nonces.allocate() for _ in range(2)] == [0, 1]
    nonces.returned(0)
    cancel = relay.sign_transaction(nonces.cancel_transaction(0, market(w3)))  # the hole filled directly
    broadcast(w3, bytes(cancel.raw_transaction))
    nonces.sent(0, "0x" + bytes(cancel.hash).hex())
    assert nonces.holes() == [] and nonces.allocate() == 2  # not 0 again
    # A settlement's own transaction sent again at its recorded nonce 5, above the next fresh one (3).
    tx_hash, raw = transfer(w3, token, relay, Account.create().address, 1_000, 5)
    broadcast(w3, raw)
    nonces.sent(5, tx_hash)
    assert nonces.allocate() == 6  # not 5
    assert nonces.resync() == [3, 4]  # 1, 2 and 6 are in senders' hands, 0 and 5 in flight
    assert redis.get(nonces.hint_key) == f"5:{tx_hash}".encode()


def test_resync_after_a_node_lost_our_transactions_reports_no_gap_and_never_moves_back(
    w3, token, relay, redis, no_mining
):
    """A lagging or load-balanced node answers a pending count below what we sent: our transactions are sent
    again at their nonces (``stuck``), never cancelled as gaps, and no nonce is handed out twice."""
    nonces = manager(w3, relay, redis)
    nonces.start(None)
    payee = Account.create().address
    sent = {}
    for _ in range(3):
        nonce = nonces.allocate()
        tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
        broadcast(w3, raw)
        nonces.sent(nonce, tx_hash)
        sent[nonce] = (tx_hash, raw)
    for tx_hash, _ in sent.values():
        rpc(w3, "anvil_dropTransaction", [tx_hash])
    assert w3.eth.get_transaction_count(relay.address, "pending") == 0
    assert nonces.resync() == []  # all three are ours, in flight
    assert nonces.next_nonce == 3  # not back to the node's 0
    assert [tx.nonce for tx in nonces.stuck(older_than=0)] == [0, 1, 2]
    for nonce in (0, 1, 2):
        broadcast(w3, sent[nonce][1])  # sent again, the same transactions
    block = mine(w3)
    assert [receipt(w3, sent[n][0])["blockNumber"] for n in (0, 1, 2)] == [block] * 3
    assert balance(token, payee) == 3_000  # each transfer once
    assert nonces.allocate() == 3


def test_a_nonce_the_chain_counted_since_is_neither_taken_back_nor_handed_out_again(w3, token, relay, redis):
    nonces = manager(w3, relay, redis)
    nonces.start(None)
    assert [nonces.allocate() for _ in range(3)] == [0, 1, 2]
    nonces.returned(1)
    payee = Account.create().address
    for nonce in range(4):  # someone else uses the account meanwhile (mined at once)
        broadcast(w3, transfer(w3, token, relay, payee, 1_000, nonce)[1])
    nonces.returned(0)
    assert nonces.holes() == [0, 1]
    assert nonces.resync() == []
    assert nonces.holes() == []  # the chain counted them: dropped
    nonces.returned(2)  # below the floor now: dropped too, not handed out again
    assert (nonces.holes(), nonces.next_nonce) == ([], 4)
    nonce = nonces.allocate()
    assert nonce == 4
    tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
    broadcast(w3, raw)  # no "nonce too low"
    # Waited for: Anvil's automine once answered the broadcast before the block held it (CI, under load).
    assert w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30, poll_latency=0.05)["status"] == 1
    assert balance(token, payee) == 5_000


def test_stuck_lists_what_waited_longer_than_asked_by_the_managers_clock(w3, token, relay, redis, no_mining):
    now = [1_000.0]
    nonces = NonceManager(w3, NETWORK, relay.address, CHAIN_ID, redis, monotonic=lambda: now[0])
    nonces.start(None)
    payee = Account.create().address
    for _ in range(2):
        nonce = nonces.allocate()
        tx_hash, raw = transfer(w3, token, relay, payee, 1_000, nonce)
        broadcast(w3, raw)
        nonces.sent(nonce, tx_hash)
        now[0] += 10
    assert nonces.stuck(older_than=30) == []  # sent 20 s and 10 s ago
    now[0] += 15
    assert [tx.nonce for tx in nonces.stuck(older_than=30)] == [0]
    mine(w3)
    now[0] += 100
    assert nonces.stuck(older_than=30) == [] and nonces.in_flight() == []  # both mined


# replacement_fees: pure


def test_replacement_fees_bump_both_fields_by_an_eighth_rounded_up():
    old = {"maxFeePerGas": 1_000, "maxPriorityFeePerGas": 101}
    assert replacement_fees(old, {"maxFeePerGas": 10, "maxPriorityFeePerGas": 1}, None) == {
        "maxFeePerGas": 1_125,
        "maxPriorityFeePerGas": 114,  # 113.625 rounded up
    }
    assert bumped(0) == 1 and bumped(1) == 2 and bumped(8) == 9 and bumped(9) == 11


def test_a_zero_tip_is_raised_by_at_least_one_wei_and_a_cancel_never_tips_above_its_fee_cap():
    assert replacement_fees({"maxFeePerGas": 10, "maxPriorityFeePerGas": 0}, {}, None) == {
        "maxFeePerGas": 12,
        "maxPriorityFeePerGas": 1,
    }
    nonces = NonceManager(Web3(), NETWORK, Account.create().address, CHAIN_ID, Redis())
    with pytest.raises(ValueError, match="tip"):
        nonces.cancel_transaction(0, {"maxFeePerGas": 10, "maxPriorityFeePerGas": 11})


def test_replacement_fees_follow_the_market_when_it_asks_more():
    old = {"maxFeePerGas": 20 * GWEI, "maxPriorityFeePerGas": GWEI}
    current = {"maxFeePerGas": 50 * GWEI, "maxPriorityFeePerGas": 3 * GWEI}
    assert replacement_fees(old, current, None) == current
    # The tip never exceeds the fee cap.
    assert replacement_fees({"maxFeePerGas": 8, "maxPriorityFeePerGas": 8}, {"maxPriorityFeePerGas": 80}, None) == {
        "maxFeePerGas": 80,
        "maxPriorityFeePerGas": 80,
    }


def test_replacement_fees_are_capped_and_none_when_the_cap_leaves_no_bump():
    old = {"maxFeePerGas": 20 * GWEI, "maxPriorityFeePerGas": GWEI}
    current = {"maxFeePerGas": 50 * GWEI, "maxPriorityFeePerGas": 30 * GWEI}
    capped = replacement_fees(old, current, cap_wei_per_gas=25 * GWEI)
    assert capped == {"maxFeePerGas": 25 * GWEI, "maxPriorityFeePerGas": 25 * GWEI}  # the cap wins over the market
    assert replacement_fees(old, current, cap_wei_per_gas=bumped(20 * GWEI)) is not None  # exactly the bump: fits
    assert replacement_fees(old, current, cap_wei_per_gas=bumped(20 * GWEI) - 1) is None
    assert replacement_fees(old, current, cap_wei_per_gas=20 * GWEI) is None  # the same fee is no replacement
    tipped = {"maxFeePerGas": 20 * GWEI, "maxPriorityFeePerGas": 20 * GWEI}
    assert replacement_fees(tipped, {}, cap_wei_per_gas=bumped(20 * GWEI)) == {
        "maxFeePerGas": bumped(20 * GWEI),
        "maxPriorityFeePerGas": bumped(20 * GWEI),
    }
    assert replacement_fees({"maxFeePerGas": 10, "maxPriorityFeePerGas": 10}, {}, cap_wei_per_gas=11) is None
