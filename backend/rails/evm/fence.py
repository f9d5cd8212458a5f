"""The lease fence of a relay account: every broadcast from a leased account checks, right before the send, that the
lease is surely this process's (``broadcast``), and a release waits for the broadcasts under way (``Owned.close``).

``accounts.AccountPool`` leases the accounts and renews ``Owned.valid_until``; the sender, the fee bump, the gap
filler and the watcher's rebroadcast (``Owned.resend``) send through ``broadcast``. docs/architecture.md, "The
pipelined EVM relay".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import requests
from eth_account.signers.local import LocalAccount
from web3.exceptions import Web3RPCError

from backend.chains.evm import RPC_CONNECT_ATTEMPTS, EvmChain
from backend.rails.evm.nonces import NonceManager


@dataclass
class Owned:
    account: LocalAccount
    manager: NonceManager
    key: str
    # The manager's clock (monotonic) until which the lease is surely ours: set at each renewal that succeeded,
    # the lease's length minus a margin after the renewal began. Checked in ``take`` and right before a broadcast.
    valid_until: float = 0.0
    given_up: bool = False  # lost or released: never valid again, whatever a renewal in flight does
    adopted: bool = False  # leased to fill a dead relayer's gaps: no new sends; released once all is mined
    # The broadcasts under way (``broadcast``: counted under ``sends`` with their lease check), waited for by a
    # release (``close``), which gives the account up under the same lock: none starts after it.
    sending: int = 0
    sends: threading.Condition = field(default_factory=threading.Condition, repr=False, compare=False)

    def valid(self) -> bool:
        return not self.given_up and time.monotonic() < self.valid_until

    def close(self, deadline: float) -> bool:
        """Given up (no broadcast starts from it any more); True once none is under way, False if one still was at
        ``deadline`` (monotonic): then its key must be left to lapse."""
        with self.sends:
            self.given_up = True
            return self.sends.wait_for(lambda: self.sending == 0, timeout=max(0.0, deadline - time.monotonic()))

    def resend(self, chain: EvmChain, raw: bytes) -> bool:
        """The watcher's rebroadcast (``pipeline.Resender``) through ``broadcast``; False: ``LeaseLost``, not sent."""
        try:
            broadcast(chain, self, raw)
        except LeaseLost:
            return False
        return True


class LeaseLost(Exception):
    """The account's lease is not surely this process's any more: nothing was broadcast."""


def broadcast(chain: EvmChain, owned: Owned, raw: bytes) -> None:
    """Check then broadcast: ``raw`` is sent only while this process surely holds ``owned``'s lease, checked right
    before the send (``LeaseLost`` otherwise). Every broadcast from a leased account goes through here.

    web3 never retries eth_sendRawTransaction (``backend.chains.evm``); a refused or reset connection is tried again
    here, up to ``RPC_CONNECT_ATTEMPTS`` tries in all, each only after the lease is checked again: never once it is
    not surely ours (the error is raised: the node may hold the first try). A release waits for the sends under way
    (``Owned.close``)."""
    failed: requests.ConnectionError | None = None
    for attempt in range(1, RPC_CONNECT_ATTEMPTS + 1):
        with owned.sends:
            if not owned.valid():
                if failed is not None:
                    raise failed  # not LeaseLost: the node may hold the try that failed
                raise LeaseLost(owned.account.address)
            owned.sending += 1
        try:
            chain.w3.eth.send_raw_transaction(raw)
            return
        except requests.ConnectionError as exc:
            if attempt == RPC_CONNECT_ATTEMPTS:
                raise
            failed = exc
        finally:
            with owned.sends:
                owned.sending -= 1
                owned.sends.notify_all()
        time.sleep(0.1 * attempt)


def node_answered(exc: BaseException) -> bool:
    """Whether a broadcast's error is the node's answer (a JSON-RPC error: refused, underpriced, overdraft, txpool
    full, nonce too high; HTTP 429): the node did not take the transaction. False for a timeout or a dropped
    connection: the node may hold it."""
    if isinstance(exc, requests.HTTPError):
        return exc.response is not None and exc.response.status_code == 429
    if isinstance(exc, requests.RequestException | TimeoutError | ConnectionError):
        return False
    return isinstance(exc, Web3RPCError | ValueError)
