"""The Solana signature poller (``backend.rails.solana.poller``) behind ``wait_landed``, on the devnet's SVM.

Many transactions in flight cost one ``getSignatureStatuses`` per tick for all of them; a transaction the node
never received (a small HTTP proxy in front of the devnet RPC swallows its send) is sent again by the poller and
lands once; one whose blockhash expired before it landed is "not landed" at once, and the settlement ends as
before (the chain decides: AUTHORIZATION_EXPIRED). Money is checked on chain.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from solders.keypair import Keypair
from solders.signature import Signature

from backend import appstate
from backend.chains.registry import ChainRegistry, Network
from backend.chains.solana import MAX_SIGNATURE_STATUSES, SolanaChain, SolanaRpcError
from backend.extensions import db
from backend.rails.base import Claim, TxState, TxStatus
from backend.rails.registry import rail_for
from backend.rails.solana import poller as poller_module
from backend.rails.solana.poller import poller_for
from backend.rails.solana.relay import SolanaRelayKeys
from backend.settlement.models import Settlement, settlement_claim
from backend.settlement.reconcile import LEDGER
from harness.proxy import RpcProxy
from payintent import solana_tx as stx
from relayer import tasks
from tests.settlement.test_pay import create_intent, events
from tests.settlement.test_pay_solana import (  # noqa: F401  (fixtures)
    SOLANA,
    buyer,
    relay_keypair,
    sol,
    sol_shop,
    usdc,
)
from tests.settlement.test_solana_already_paid import _cosigned_claim, relay_keys, row  # noqa: F401


class Proxy(RpcProxy):
    """The devnet's Solana RPC behind a proxy that counts calls and swallows the next ``drop`` sends (answered
    with the signature, as a node that accepted them and lost them would); ``refuse_batches``: as some RPCs;
    ``hang_resends``: a ``skipPreflight`` send (the poller's) hangs until the proxy closes; ``fail_statuses``:
    ``getSignatureStatuses`` answers an error."""

    def __init__(self, upstream: str) -> None:
        self.batches = 0
        self.refuse_batches = False
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.status_batches: list[int] = []
        self.drop = 0
        self.drop_all = False
        self.dropped = 0
        self.hang = 0.0
        self.hang_resends = False
        self.hung = 0
        self.released = threading.Event()
        self.fail_statuses = False
        self.sent: set[str] = set()  # the signatures of every sendTransaction
        super().__init__(upstream)

    def handle(self, body: Any) -> Any:
        """Each call of a batch is answered (and forwarded) alone."""
        if not isinstance(body, list):
            return self.answer(body)
        if self.refuse_batches:
            return {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "no batches"}}
        answers = [self.answer(call) for call in body]
        self.batches += 1
        return answers

    def answer(self, call: dict[str, Any]) -> Any:
        method = call.get("method")
        with self.lock:
            self.calls[method] += 1
            if method == "getSignatureStatuses":
                self.status_batches.append(len(call["params"][0]))
                if self.fail_statuses:
                    return {"jsonrpc": "2.0", "id": call["id"], "error": {"code": -32005, "message": "unhealthy"}}
            resent = method == "sendTransaction" and (call["params"][1:] or [{}])[0].get("skipPreflight")
            hung = bool(resent and self.hang_resends)
            self.hung += hung
            if method == "sendTransaction":
                self.sent.add(str(stx.decode(call["params"][0]).signatures[0]))
            dropped = method == "sendTransaction" and (self.drop > 0 or self.drop_all)
            if dropped:
                self.drop -= 1
                self.dropped += 1
        if self.hang:
            time.sleep(self.hang)
        if hung:
            self.released.wait()
            return {"jsonrpc": "2.0", "id": call["id"], "error": {"code": -32005, "message": "hung"}}
        if dropped:
            signature = str(stx.decode(call["params"][0]).signatures[0])
            return {"jsonrpc": "2.0", "id": call["id"], "result": signature}
        return self.forward(call)

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.status_batches.clear()
            self.sent.clear()

    def close(self) -> None:
        self.released.set()
        super().close()


@pytest.fixture
def proxy(devnet: Any) -> Iterator[Proxy]:
    with Proxy(devnet.chains.get(SOLANA).rpc_url) as server:
        yield server


@pytest.fixture
def proxied(devnet: Any, proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> Network:
    """The Solana network reached through the proxy, for the relayer's job too (``appstate.chains``)."""
    network = dataclasses.replace(devnet.chains.get(SOLANA), rpc_url=proxy.url)
    registry = ChainRegistry([network if n.network == SOLANA else n for n in devnet.chains])
    monkeypatch.setattr(appstate, "chains", lambda app=None: registry)
    return network


def any_height(height: int) -> bool:
    """A waiter's ``still_valid`` for a signature whose blockhash never expires."""
    return True


@dataclasses.dataclass
class Paying:
    """A Solana merchant paid through the proxy: the app's client, the devnet, the merchant (``sol_shop``), the
    network through the proxy (``proxied``) and the devnet's own client (``sol``, not proxied)."""

    client: Any
    devnet: Any
    merchant: Any
    network: Network
    sol: SolanaChain

    def payer(self, index: int) -> Keypair:
        return buyer(self.devnet, index)

    def usdc(self, owner: Keypair | str | None = None) -> int:
        """The USDC of ``owner`` (a keypair or an address; the merchant's if None), in base units."""
        address = owner if isinstance(owner, str) else self.merchant.wallet if owner is None else str(owner.pubkey())
        return usdc(self.sol, self.devnet, address)

    def cosigned(self, amount: float, payer: Keypair) -> tuple[str, str, Any]:
        """An intent and its settlement of ``payer``'s transaction, co-signed, claimed, not sent yet: (intent id,
        settlement id, the co-signed transaction)."""
        intent = create_intent(self.client, self.merchant, amount)
        settlement_id, cosigned = _cosigned_claim(self.client, self.devnet, self.merchant, intent, payer, claimed=True)
        return intent["intent_id"], settlement_id, cosigned

    def submitted(self, amount: float, payer: Keypair) -> Claim:
        """The claim of a settlement of ``payer``'s transaction, co-signed and submitted through the proxy."""
        _, settlement_id, _ = self.cosigned(amount, payer)
        claim = settlement_claim(row(settlement_id))
        keys = SolanaRelayKeys(relay_keypair(self.devnet))
        submission = rail_for(self.network).submit(self.network, claim, keys, None, LEDGER, lambda *a: None)  # type: ignore[arg-type]
        assert submission.tx_id == claim.tx_id  # the signature recorded before the send
        return claim

    def wait_landed(self, claim: Claim, timeout: float) -> TxStatus | None:
        return rail_for(self.network).wait_landed(self.network, claim, timeout)


@pytest.fixture
def paying(pay_client: Any, devnet: Any, sol_shop: Any, proxied: Network, sol: SolanaChain) -> Paying:  # noqa: F811
    return Paying(pay_client, devnet, sol_shop, proxied, sol)


def test_many_waiters_cost_one_status_read_per_tick_and_a_dropped_send_is_sent_again(paying, proxy, monkeypatch):
    payers = [paying.payer(i % 3) for i in range(12)]
    before = {str(p.pubkey()): paying.usdc(p) for p in payers}
    proxy.drop = len(payers)  # every first send is lost: all twelve are in flight together
    with monkeypatch.context() as patch:
        patch.setattr(poller_module, "RESEND_SECONDS", 3600.0)  # none sent again while the others are submitted
        claims = [paying.submitted(1, p) for p in payers]
    assert proxy.dropped == len(payers) and paying.usdc() == 0  # the SVM received none
    poller = poller_for(paying.network.rpc_url or "")
    ticks = poller.counter.ticks
    proxy.reset()
    started = time.monotonic()
    with ThreadPoolExecutor(len(claims)) as pool:
        landed = list(pool.map(lambda c: paying.wait_landed(c, 30), claims))
    elapsed = time.monotonic() - started
    assert all(isinstance(s, TxStatus) and s.state is TxState.SUCCEEDED and s.final for s in landed), landed
    # One getSignatureStatuses per tick for all twelve (not one per waiter per poll), one height read at most.
    polls = poller.counter.ticks - ticks
    # (A tick counted before the reset may reach the proxy after it: one more call.)
    assert 1 <= polls <= proxy.calls["getSignatureStatuses"] <= polls + 1
    # Each call asks about every signature still in flight: all twelve, then fewer as they land.
    batches = proxy.status_batches[proxy.status_batches.index(len(claims)) :]
    assert batches == sorted(batches, reverse=True) and len(batches) >= polls - 1
    assert proxy.calls["getBlockHeight"] <= polls + 1
    assert polls <= elapsed / poller_module.TICK_SECONDS + 2
    # Each was sent again once by the poller and landed once: buyers debited once, the merchant credited once.
    # (One landing slower than a re-send's interval under load is sent twice: still one signature, paid once.)
    assert proxy.calls["sendTransaction"] >= len(claims) and proxy.batches >= 1  # in JSON-RPC batches
    assert proxy.sent == {c.tx_id for c in claims}
    assert paying.usdc() == 12_000_000
    for owner, amount in before.items():
        assert amount - paying.usdc(owner) == 4_000_000
    assert all(paying.sol.signature_status(c.tx_id or "") is not None for c in claims)


@pytest.mark.parametrize("refuse_batches", [False, True])
def test_the_relayer_job_with_a_lost_send_ends_paid_once(refuse_batches, paying, proxy, relay_keys):  # noqa: F811
    payer = paying.payer(1)
    intent_id, settlement_id, cosigned = paying.cosigned(2, payer)
    signature = str(cosigned.signatures[0])
    before = paying.usdc(payer)
    proxy.drop = 1  # the job's send never reaches the SVM
    proxy.refuse_batches = refuse_batches  # the poller's batched re-send falls back to one call each
    assert tasks._settle(settlement_id, None) == "confirmed"  # type: ignore[arg-type]
    assert proxy.dropped == 1 and proxy.calls["sendTransaction"] == 2  # the poller sent it again, once
    settled = row(settlement_id)
    assert (settled.status, settled.tx_hash) == ("confirmed", signature)
    assert paying.usdc() == 2_000_000
    assert before - paying.usdc(payer) == 2_000_000
    assert len([e for e in events("payment.completed") if e["data"]["intent_id"] == intent_id]) == 1


def test_not_landed_while_the_blockhash_is_valid_leaves_the_job_waiting_then_the_chain_fails_it(
    paying,
    sol,  # noqa: F811
    proxy,
    relay_keys,  # noqa: F811
):
    payer = paying.payer(2)
    before = paying.usdc(payer)
    proxy.drop_all = True  # lost, and every re-send too
    _, settlement_id, cosigned = paying.cosigned(1, payer)
    # The row's last valid block height is near: the poller calls it "not landed" within seconds, while the
    # transaction's own blockhash is still valid on the node (it could still land).
    height = sol.block_height("finalized") + 5
    db.session.execute(db.update(Settlement).where(Settlement.id == settlement_id)
                       .values(last_valid_block_height=height))  # fmt: skip
    db.session.commit()
    started = time.monotonic()
    assert tasks._settle(settlement_id, None) == "waiting-for-receipt"  # type: ignore[arg-type]
    assert time.monotonic() - started < 30  # the height passed the row's last valid one, not the 60 s wait
    assert sol.is_blockhash_valid(str(cosigned.message.recent_blockhash))
    settled = row(settlement_id)
    assert (settled.status, settled.tx_hash) == ("submitted", str(cosigned.signatures[0]))  # nothing released
    assert paying.usdc() == 0 and paying.usdc(payer) == before
    # "Not landed" ends the poller's re-sends of it.
    sends = proxy.calls["sendTransaction"]
    time.sleep(poller_module.RESEND_SECONDS + 1)
    assert proxy.calls["sendTransaction"] == sends
    # The settlement ends as it did before the poller: left for the chain, failed once the blockhash is dead.
    sol.call("devnet_expireBlockhashes")
    proxy.drop_all = False
    assert tasks._settle(settlement_id, None) == "finished-from-chain"  # type: ignore[arg-type]
    settled = row(settlement_id)
    assert (settled.status, settled.failure_code) == ("failed", "AUTHORIZATION_EXPIRED")
    assert sol.signature_status(str(cosigned.signatures[0])) is None
    assert paying.usdc() == 0 and paying.usdc(payer) == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread killed on purpose
def test_a_waiter_never_waits_past_its_timeout_and_a_dead_poller_thread_is_started_again(paying, proxy, monkeypatch):
    poller = poller_for(paying.network.rpc_url or "")
    # The RPC hangs longer than the waiter's timeout: the waiter returns at its timeout all the same.
    proxy.hang = 4.0
    started = time.monotonic()
    assert poller.wait(str(Signature.new_unique()), any_height, 0.5) is None
    assert time.monotonic() - started < 3.5
    proxy.hang = 0.0
    proxy.drop = 1  # it lands only once the poller sends it again: the thread dies before
    claim = paying.submitted(1, paying.payer(0))
    signature = claim.tx_id or ""
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(paying.wait_landed, claim, 30)
        while poller._entries[signature].waiters == 0:
            time.sleep(0.01)
        # The thread's next tick kills it (a SystemExit goes through its catch-all); only the waiter can start
        # it again (no track, no new waiter comes).
        first = poller._thread
        real_tick = poller.tick
        died = threading.Event()

        def die_once() -> None:
            if not died.is_set():
                died.set()
                raise SystemExit
            real_tick()

        monkeypatch.setattr(poller, "tick", die_once)
        status = waiting.result()
    assert died.is_set() and status is not None and status.state is TxState.SUCCEEDED
    assert first is not None and not first.is_alive() and poller._thread is not first
    assert paying.usdc() == 1_000_000


def test_status_reads_go_on_while_the_node_hangs_on_sends(paying, proxy):
    proxy.drop = 1
    proxy.hang_resends = True  # the poller's re-sends hang (the relay's own sends do not)
    paying.submitted(1, paying.payer(0))  # lost: the poller sends it again
    deadline = time.monotonic() + 30
    while not proxy.hung and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.hung  # a re-send hangs in the poller's tick now
    claim = paying.submitted(2, paying.payer(1))  # sent and landed
    # Seen within seconds: the hanging re-send is cut short (no call per transaction after a timeout).
    status = paying.wait_landed(claim, 5)
    assert status is not None and status.state is TxState.SUCCEEDED
    assert paying.usdc() == 2_000_000  # the lost one never reached the SVM


def _airdropped(chain: SolanaChain) -> str:
    """A landed signature (confirmed)."""
    signature = str(chain.call("requestAirdrop", [str(Keypair().pubkey()), 1_000_000]))
    deadline = time.monotonic() + 30
    while (chain.signature_status(signature) or {}).get("confirmationStatus") not in ("confirmed", "finalized"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return signature


def test_statuses_of_more_than_the_nodes_limit_take_one_call_per_chunk_in_order(sol, proxy):  # noqa: F811
    landed = {0: _airdropped(sol), 255: _airdropped(sol), 256: _airdropped(sol)}
    signatures = [landed.get(i) or str(Signature.new_unique()) for i in range(MAX_SIGNATURE_STATUSES + 44)]
    proxy.reset()
    statuses = SolanaChain(proxy.url).signature_statuses(signatures)
    assert proxy.status_batches == [MAX_SIGNATURE_STATUSES, 44]
    assert [i for i, status in enumerate(statuses) if status is not None] == sorted(landed)
    for i, signature in landed.items():
        assert statuses[i]["slot"] == sol.signature_status(signature)["slot"]  # type: ignore[index]


def test_waiters_raise_after_failed_reads_and_a_later_waiter_is_answered(sol, proxy):  # noqa: F811
    signature = _airdropped(sol)
    poller = poller_for(proxy.url)
    proxy.fail_statuses = True
    started = time.monotonic()
    with pytest.raises(SolanaRpcError, match="unhealthy"):
        poller.wait(signature, any_height, 30)
    assert time.monotonic() - started < 20  # after FAILURES_BEFORE_RAISE reads, not the timeout
    proxy.fail_statuses = False  # the node is back: an earlier outage is not raised in a new waiter
    status = poller.wait(signature, any_height, 30)
    assert status is not None and status["confirmationStatus"] in poller_module.LANDED


class DeadRpc:
    """A Solana RPC that is gone (a stopped devnet): every read fails."""

    def __init__(self) -> None:
        self.reads = 0

    def signature_statuses(self, signatures: list[str], search_history: bool = False) -> list[Any]:
        self.reads += 1
        raise SolanaRpcError("getSignatureStatuses: RPC unreachable or malformed answer (ConnectionError)")


def test_a_poller_whose_rpc_is_gone_warns_once_and_backs_off_until_someone_waits(monkeypatch, caplog):
    monkeypatch.setattr(poller_module, "RESEND_FOR_SECONDS", 4.0)  # the thread ends soon after the test
    monkeypatch.setattr(poller_module, "IDLE_EXIT_SECONDS", 0.5)
    dead = DeadRpc()
    poller = poller_module.SignaturePoller(dead, tick_seconds=0.05)  # type: ignore[arg-type]
    signature = str(Signature.new_unique())
    with caplog.at_level(logging.DEBUG, logger=poller_module.__name__):
        poller.track(signature, "AA==", any_height)  # sent: polled to be sent again, nobody waits
        time.sleep(2.0)
        # Its own logger's records only: caplog also holds what other threads of this process log meanwhile.
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == poller_module.__name__]
        assert len(warnings) == 1 and "RPC unreachable" in warnings[0].getMessage()
        # Backing off: 0.1, 0.2, 0.4, 0.8 s... (about 40 reads at the tick in 2 s).
        assert 3 <= dead.reads <= 7
        # A waiter ends the back-off: told of the outage within a few ticks, not after the back-off.
        started = time.monotonic()
        with pytest.raises(SolanaRpcError, match="unreachable"):
            poller.wait(signature, any_height, 10)
        assert time.monotonic() - started < 0.6
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING and r.name == poller_module.__name__]) == 1
