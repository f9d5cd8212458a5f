"""TestUSDC on a real Anvil chain: metadata, EIP-712 domain, EIP-3009 authorizations, minting.

Every authorization is signed off-chain with ``Account.sign_typed_data`` exactly as a buyer's wallet
would, then submitted by another account, so these tests pin down what the relayer relies on.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from eth_account import Account
from eth_account.messages import encode_typed_data
from eth_account.signers.local import LocalAccount
from eth_keys.constants import SECPK1_N
from eth_utils import keccak
from web3 import Web3
from web3.contract import Contract
from web3.exceptions import ContractCustomError, ContractLogicError
from web3.logs import DISCARD

from tests.devnet.chain import ARTIFACT, CHAIN_ID, FOUNDRY_HOME, ROOT, USDC, Accounts, Anvil, send, tree

AUTH_FIELDS = [
    {"name": "from", "type": "address"},
    {"name": "to", "type": "address"},
    {"name": "value", "type": "uint256"},
    {"name": "validAfter", "type": "uint256"},
    {"name": "validBefore", "type": "uint256"},
    {"name": "nonce", "type": "bytes32"},
]
CANCEL_FIELDS = [{"name": "authorizer", "type": "address"}, {"name": "nonce", "type": "bytes32"}]
TYPE_STRINGS = {
    "TRANSFER_WITH_AUTHORIZATION_TYPEHASH": "TransferWithAuthorization(address from,address to,uint256 value,"
    "uint256 validAfter,uint256 validBefore,bytes32 nonce)",
    "RECEIVE_WITH_AUTHORIZATION_TYPEHASH": "ReceiveWithAuthorization(address from,address to,uint256 value,"
    "uint256 validAfter,uint256 validBefore,bytes32 nonce)",
    "CANCEL_AUTHORIZATION_TYPEHASH": "CancelAuthorization(address authorizer,bytes32 nonce)",
}
AUTH_ARGS = "address,address,uint256,uint256,uint256,bytes32"
VRS = "uint8,bytes32,bytes32"

USED = "FiatTokenV2: authorization is used or canceled"
INVALID_SIGNATURE = "FiatTokenV2: invalid signature"


# --- helpers ------------------------------------------------------------------------------------


def domain(token: Contract, chain_id: int = CHAIN_ID) -> dict[str, Any]:
    return {"name": "USDC", "version": "2", "chainId": chain_id, "verifyingContract": token.address}


def chain_time(w3: Web3) -> int:
    return w3.eth.get_block("latest")["timestamp"]


@dataclass(frozen=True)
class Authorization:
    """A signed EIP-3009 Transfer/ReceiveWithAuthorization: the message, and the signature over it."""

    from_: str
    to: str
    value: int
    valid_after: int
    valid_before: int
    nonce: bytes
    v: int
    r: bytes
    s: bytes

    @property
    def signature(self) -> bytes:
        return self.r + self.s + bytes([self.v])

    def args(self) -> tuple[Any, ...]:
        return (self.from_, self.to, self.value, self.valid_after, self.valid_before, self.nonce)


def sign_authorization(
    signer: LocalAccount,
    token: Contract,
    *,
    from_: str,
    to: str,
    value: int,
    valid_after: int,
    valid_before: int,
    nonce: bytes | None = None,
    primary_type: str = "TransferWithAuthorization",
    chain_id: int = CHAIN_ID,
) -> Authorization:
    nonce = os.urandom(32) if nonce is None else nonce
    message = {
        "from": from_,
        "to": to,
        "value": value,
        "validAfter": valid_after,
        "validBefore": valid_before,
        "nonce": nonce,
    }
    signed = Account.sign_typed_data(signer.key, domain(token, chain_id), {primary_type: AUTH_FIELDS}, message)
    return Authorization(from_, to, value, valid_after, valid_before, nonce, signed.v, _word(signed.r), _word(signed.s))


def sign_cancel(signer: LocalAccount, token: Contract, authorizer: str, nonce: bytes) -> Any:
    message = {"authorizer": authorizer, "nonce": nonce}
    return Account.sign_typed_data(signer.key, domain(token), {"CancelAuthorization": CANCEL_FIELDS}, message)


def _word(n: int) -> bytes:
    return n.to_bytes(32, "big")


def transfer_vrs(token: Contract, auth: Authorization) -> Any:
    fn = token.get_function_by_signature(f"transferWithAuthorization({AUTH_ARGS},{VRS})")
    return fn(*auth.args(), auth.v, auth.r, auth.s)


def transfer_bytes(token: Contract, auth: Authorization) -> Any:
    fn = token.get_function_by_signature(f"transferWithAuthorization({AUTH_ARGS},bytes)")
    return fn(*auth.args(), auth.signature)


def receive_vrs(token: Contract, auth: Authorization) -> Any:
    fn = token.get_function_by_signature(f"receiveWithAuthorization({AUTH_ARGS},{VRS})")
    return fn(*auth.args(), auth.v, auth.r, auth.s)


def receive_bytes(token: Contract, auth: Authorization) -> Any:
    fn = token.get_function_by_signature(f"receiveWithAuthorization({AUTH_ARGS},bytes)")
    return fn(*auth.args(), auth.signature)


def assert_reverts(w3: Web3, sender: LocalAccount, call: Any, reason: str) -> None:
    """``call`` reverts with ``reason`` both in eth_call and as a mined transaction (status 0)."""
    with pytest.raises(ContractLogicError, match=re.escape(reason)):
        call.call({"from": sender.address})
    assert send(w3, sender, call, gas=300_000)["status"] == 0


def balances(token: Contract, *holders: LocalAccount) -> list[int]:
    return [token.functions.balanceOf(h.address).call() for h in holders]


@pytest.fixture
def window(w3: Web3) -> dict[str, int]:
    """A validity window that is open now and for the next hour of chain time."""
    return {"valid_after": 0, "valid_before": chain_time(w3) + 3600}


# --- the artifact ---------------------------------------------------------------------------------


def test_artifact_matches_source(artifact: dict[str, Any]) -> None:
    source = ROOT / artifact["source"]["path"]
    assert hashlib.sha256(source.read_bytes()).hexdigest() == artifact["source"]["sha256"], (
        "devnet/artifacts/TestUSDC.json is stale: run `node devnet/build_contract.mjs`"
    )
    assert artifact["compiler"]["version"].startswith("0.8.")
    assert re.fullmatch(r"0x[0-9a-f]+", artifact["bytecode"])


def test_artifact_is_reproducible() -> None:
    node = shutil.which("node")
    if node is None or not (ROOT / "node_modules" / "solc").is_dir():
        pytest.skip("node or node_modules/solc is missing: run `npm ci` at the repository root")
    result = subprocess.run(
        [node, "devnet/build_contract.mjs", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert ARTIFACT.name in result.stdout


# --- metadata and EIP-712 domain ------------------------------------------------------------------


def test_metadata_and_domain(token: Contract, accounts: Accounts) -> None:
    fns = token.functions
    assert (fns.name().call(), fns.symbol().call(), fns.decimals().call(), fns.version().call()) == (
        "USDC",
        "USDC",
        6,
        "2",
    )
    assert fns.owner().call() == accounts.owner.address
    assert fns.totalSupply().call() == 1_000 * USDC

    _fields, name, version, chain_id, verifying_contract, _salt, _extensions = fns.eip712Domain().call()
    assert (name, version, chain_id, verifying_contract) == ("USDC", "2", CHAIN_ID, token.address)

    # The on-chain separator is the one a wallet computes from the published domain.
    signable = encode_typed_data(
        domain(token), {"CancelAuthorization": CANCEL_FIELDS}, {"authorizer": token.address, "nonce": b"\0" * 32}
    )
    assert fns.DOMAIN_SEPARATOR().call() == signable.header

    for constant, type_string in TYPE_STRINGS.items():
        assert getattr(fns, constant)().call() == keccak(text=type_string), constant


# --- transferWithAuthorization --------------------------------------------------------------------


@pytest.mark.parametrize("submit", [transfer_vrs, transfer_bytes], ids=["v,r,s", "bytes"])
def test_relayed_transfer_moves_exactly_value(
    w3: Web3,
    token: Contract,
    accounts: Accounts,
    window: dict[str, int],
    submit: Callable[[Contract, Authorization], Any],
) -> None:
    buyer, payee, relayer = accounts.buyer, accounts.payee, accounts.relayer
    value = 12_345_678  # 12.345678 USDC
    auth = sign_authorization(buyer, token, from_=buyer.address, to=payee.address, value=value, **window)
    assert token.functions.authorizationState(buyer.address, auth.nonce).call() is False
    before = balances(token, buyer, payee, relayer)

    receipt = send(w3, relayer, submit(token, auth))

    assert receipt["status"] == 1
    assert receipt["from"] == relayer.address
    assert balances(token, buyer, payee, relayer) == [before[0] - value, before[1] + value, before[2]]
    assert token.functions.totalSupply().call() == 1_000 * USDC
    (used,) = token.events.AuthorizationUsed().process_receipt(receipt, errors=DISCARD)
    assert (used.args.authorizer, used.args.nonce) == (buyer.address, auth.nonce)
    (moved,) = token.events.Transfer().process_receipt(receipt, errors=DISCARD)
    assert (moved.args["from"], moved.args.to, moved.args.value) == (buyer.address, payee.address, value)
    assert token.functions.authorizationState(buyer.address, auth.nonce).call() is True

    # Replaying the same authorization, through either overload, fails and moves nothing.
    after = balances(token, buyer, payee)
    for replay in (transfer_vrs, transfer_bytes):
        assert_reverts(w3, relayer, replay(token, auth), USED)
    assert balances(token, buyer, payee) == after


def _expired(auth: Authorization, w3: Web3, accounts: Accounts, token: Contract) -> tuple[Authorization, str]:
    now = chain_time(w3)
    return _resign(auth, accounts.buyer, token, valid_before=now - 1), "FiatTokenV2: authorization is expired"


def _not_yet_valid(auth: Authorization, w3: Web3, accounts: Accounts, token: Contract) -> tuple[Authorization, str]:
    now = chain_time(w3)
    return _resign(auth, accounts.buyer, token, valid_after=now + 3600), "FiatTokenV2: authorization is not yet valid"


def _wrong_signer(auth: Authorization, w3: Web3, accounts: Accounts, token: Contract) -> tuple[Authorization, str]:
    return _resign(auth, accounts.outsider, token), INVALID_SIGNATURE


def _tampered_value(auth: Authorization, w3: Web3, accounts: Accounts, token: Contract) -> tuple[Authorization, str]:
    return replace(auth, value=auth.value + 1), INVALID_SIGNATURE


def _tampered_payee(auth: Authorization, w3: Web3, accounts: Accounts, token: Contract) -> tuple[Authorization, str]:
    return replace(auth, to=accounts.relayer.address), INVALID_SIGNATURE


def _other_chain(auth: Authorization, w3: Web3, accounts: Accounts, token: Contract) -> tuple[Authorization, str]:
    return _resign(auth, accounts.buyer, token, chain_id=8453), INVALID_SIGNATURE


def _receive_typed(auth: Authorization, w3: Web3, accounts: Accounts, token: Contract) -> tuple[Authorization, str]:
    return _resign(auth, accounts.buyer, token, primary_type="ReceiveWithAuthorization"), INVALID_SIGNATURE


def _high_s(auth: Authorization, w3: Web3, accounts: Accounts, token: Contract) -> tuple[Authorization, str]:
    # The malleable twin (n - s, flipped v) recovers the same signer; ECDSA.tryRecover must refuse it.
    s = SECPK1_N - int.from_bytes(auth.s, "big")
    return replace(auth, s=_word(s), v=55 - auth.v), INVALID_SIGNATURE


def _resign(auth: Authorization, signer: LocalAccount, token: Contract, **changes: Any) -> Authorization:
    fields = {
        "from_": auth.from_,
        "to": auth.to,
        "value": auth.value,
        "valid_after": auth.valid_after,
        "valid_before": auth.valid_before,
        "nonce": auth.nonce,
    }
    return sign_authorization(signer, token, **(fields | changes))


@pytest.mark.parametrize(
    "spoil",
    [
        _expired,
        _not_yet_valid,
        _wrong_signer,
        _tampered_value,
        _tampered_payee,
        _other_chain,
        _receive_typed,
        _high_s,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_bad_authorization_reverts(
    w3: Web3,
    token: Contract,
    accounts: Accounts,
    window: dict[str, int],
    spoil: Callable[..., tuple[Authorization, str]],
) -> None:
    buyer, payee, relayer = accounts.buyer, accounts.payee, accounts.relayer
    good = sign_authorization(buyer, token, from_=buyer.address, to=payee.address, value=5 * USDC, **window)
    bad, reason = spoil(good, w3, accounts, token)
    before = balances(token, buyer, payee, relayer)

    for submit in (transfer_vrs, transfer_bytes):
        assert_reverts(w3, relayer, submit(token, bad), reason)

    assert balances(token, buyer, payee, relayer) == before
    assert token.functions.authorizationState(buyer.address, good.nonce).call() is False
    # The failed attempts burned nothing: the genuine authorization still goes through.
    assert send(w3, relayer, transfer_vrs(token, good))["status"] == 1
    assert balances(token, buyer, payee) == [before[0] - 5 * USDC, before[1] + 5 * USDC]


def test_malformed_signature_bytes_revert(
    w3: Web3, token: Contract, accounts: Accounts, window: dict[str, int]
) -> None:
    buyer, payee, relayer = accounts.buyer, accounts.payee, accounts.relayer
    auth = sign_authorization(buyer, token, from_=buyer.address, to=payee.address, value=USDC, **window)
    fn = token.get_function_by_signature(f"transferWithAuthorization({AUTH_ARGS},bytes)")
    for signature in (b"", auth.signature[:64], auth.signature + b"\0", b"\0" * 65):
        assert_reverts(w3, relayer, fn(*auth.args(), signature), INVALID_SIGNATURE)


# --- receiveWithAuthorization ---------------------------------------------------------------------


@pytest.mark.parametrize("submit", [receive_vrs, receive_bytes], ids=["v,r,s", "bytes"])
def test_receive_requires_the_payee_as_caller(
    w3: Web3,
    token: Contract,
    accounts: Accounts,
    window: dict[str, int],
    submit: Callable[[Contract, Authorization], Any],
) -> None:
    buyer, payee, relayer = accounts.buyer, accounts.payee, accounts.relayer
    auth = sign_authorization(
        buyer,
        token,
        from_=buyer.address,
        to=payee.address,
        value=7 * USDC,
        primary_type="ReceiveWithAuthorization",
        **window,
    )
    before = balances(token, buyer, payee)

    # A front-runner who saw the authorization cannot execute it.
    assert_reverts(w3, relayer, submit(token, auth), "FiatTokenV2: caller must be the payee")
    assert balances(token, buyer, payee) == before

    receipt = send(w3, payee, submit(token, auth))
    assert receipt["status"] == 1
    assert balances(token, buyer, payee) == [before[0] - 7 * USDC, before[1] + 7 * USDC]
    (used,) = token.events.AuthorizationUsed().process_receipt(receipt, errors=DISCARD)
    assert (used.args.authorizer, used.args.nonce) == (buyer.address, auth.nonce)
    assert_reverts(w3, payee, submit(token, auth), USED)

    # A TransferWithAuthorization signature is not a ReceiveWithAuthorization one.
    transfer_auth = sign_authorization(buyer, token, from_=buyer.address, to=payee.address, value=USDC, **window)
    assert_reverts(w3, payee, submit(token, transfer_auth), INVALID_SIGNATURE)


# --- cancelAuthorization --------------------------------------------------------------------------


@pytest.mark.parametrize("overload", ["v,r,s", "bytes"])
def test_cancel_blocks_a_later_transfer(
    w3: Web3, token: Contract, accounts: Accounts, window: dict[str, int], overload: str
) -> None:
    buyer, payee, relayer, outsider = accounts.buyer, accounts.payee, accounts.relayer, accounts.outsider
    auth = sign_authorization(buyer, token, from_=buyer.address, to=payee.address, value=3 * USDC, **window)

    def cancel(signed: Any) -> Any:
        if overload == "bytes":
            fn = token.get_function_by_signature("cancelAuthorization(address,bytes32,bytes)")
            return fn(buyer.address, auth.nonce, bytes(signed.signature))
        fn = token.get_function_by_signature(f"cancelAuthorization(address,bytes32,{VRS})")
        return fn(buyer.address, auth.nonce, signed.v, _word(signed.r), _word(signed.s))

    # Only the authorizer's signature cancels.
    assert_reverts(w3, relayer, cancel(sign_cancel(outsider, token, buyer.address, auth.nonce)), INVALID_SIGNATURE)
    assert token.functions.authorizationState(buyer.address, auth.nonce).call() is False

    # Anyone may submit the buyer's signed cancellation.
    receipt = send(w3, relayer, cancel(sign_cancel(buyer, token, buyer.address, auth.nonce)))
    assert receipt["status"] == 1
    (canceled,) = token.events.AuthorizationCanceled().process_receipt(receipt, errors=DISCARD)
    assert (canceled.args.authorizer, canceled.args.nonce) == (buyer.address, auth.nonce)
    assert token.functions.authorizationState(buyer.address, auth.nonce).call() is True

    before = balances(token, buyer, payee)
    assert_reverts(w3, relayer, transfer_vrs(token, auth), USED)
    assert_reverts(w3, relayer, transfer_bytes(token, auth), USED)
    assert_reverts(w3, relayer, cancel(sign_cancel(buyer, token, buyer.address, auth.nonce)), USED)
    assert balances(token, buyer, payee) == before


# --- minting --------------------------------------------------------------------------------------


def test_only_the_owner_mints(w3: Web3, token: Contract, accounts: Accounts) -> None:
    outsider, payee = accounts.outsider, accounts.payee
    selector = keccak(text="OwnableUnauthorizedAccount(address)")[:4].hex()
    with pytest.raises(ContractCustomError) as excinfo:
        token.functions.mint(outsider.address, USDC).call({"from": outsider.address})
    assert selector in str(excinfo.value.data)
    assert outsider.address[2:].lower() in str(excinfo.value.data).lower()
    assert send(w3, outsider, token.functions.mint(outsider.address, USDC), gas=200_000)["status"] == 0
    assert token.functions.balanceOf(outsider.address).call() == 0

    assert send(w3, accounts.owner, token.functions.mint(payee.address, 2 * USDC))["status"] == 1
    assert token.functions.balanceOf(payee.address).call() == 2 * USDC
    assert token.functions.totalSupply().call() == 1_002 * USDC


# --- the node itself ------------------------------------------------------------------------------


def test_anvil_writes_nothing_to_disk(w3: Web3, anvil: Anvil, accounts: Accounts) -> None:
    # Without --prune-history, this many blocks makes Anvil spill states into ~/.foundry/anvil/tmp.
    w3.provider.make_request("anvil_mine", [hex(1_000)])
    w3.provider.make_request("anvil_setBalance", [accounts.outsider.address, hex(100 * 10**18)])
    assert w3.eth.block_number >= 1_000
    assert tree(anvil.cache_dir) == set()
    assert tree(FOUNDRY_HOME) - anvil.foundry_before == set()
