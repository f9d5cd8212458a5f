"""/pay's pre-claim reads (``rails.evm.rail.read_pre_claim_state``): one JSON-RPC batch with calldata encoded by
hand, against a node that answers what each test needs (the fake node of test_evm_rpcbatch). Every answer that is
not the token's (a revert, an empty or short word, a bool other than 0/1, a block without a hex number or time, bad
code hex, a rate limit, a 5xx) is the chain's trouble: 503 CHAIN_UNAVAILABLE, never a decision about the payment."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from backend.chains.evm import EvmChain
from backend.chains.registry import Network
from backend.errors import ChainUnavailable, DomainError
from backend.rails.evm import rail
from backend.rails.evm.terms import EvmTerms
from tests.rails.test_evm_rpcbatch import FakeNode

PAYER = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
NONCE = bytes(range(32))


def word(n: int) -> str:
    return "0x" + f"{n:064x}"


class TokenNode(FakeNode):
    """A node whose token answers authorizationState and balanceOf from its fields."""

    def __init__(self) -> None:
        self.used: Any = word(0)
        self.balance: Any = word(10**6)
        self.code = "0x"
        self.block: Any = {"number": "0x10", "timestamp": hex(2_000_000_000)}
        self.call_data: list[str] = []
        super().__init__()

    def answer(self, call: dict[str, Any], in_batch: bool) -> dict[str, Any]:
        method, params = call["method"], call["params"]
        if self.fail(method, params, in_batch) is not None or method not in (
            "eth_call",
            "eth_getCode",
            "eth_getBlockByNumber",
        ):
            return super().answer(call, in_batch)  # fmt: skip
        if method == "eth_call":
            data = params[0]["data"]
            self.call_data.append(data)
            result = self.used if data.startswith("0x" + rail._AUTHORIZATION_STATE.hex()) else self.balance
        else:
            result = self.code if method == "eth_getCode" else self.block
        return {"jsonrpc": "2.0", "id": call["id"], "result": result}


@pytest.fixture
def node() -> Iterator[TokenNode]:
    with TokenNode() as running:
        yield running


def network_of(node: TokenNode) -> Network:
    rail._PRE_CLAIM_RPC.clear()  # a node that refused batches is remembered per network
    return Network(network="eip155:84532", name="fake", kind="evm", rpc_url=node.url,
                   usdc_address="0x" + "11" * 20, confirmations=1)  # fmt: skip


TERMS = EvmTerms(payer=PAYER, pay_to="0x" + "33" * 20, value=1, valid_after=0, valid_before=2**40, nonce=NONCE,
                 signature_hex="0x", raw={})  # fmt: skip


def test_one_batch_whose_calldata_is_the_tokens_abi(node):
    network = network_of(node)
    state = rail.read_pre_claim_state(network, TERMS)
    assert state == rail.PreClaimState(False, False, 10**6, 16, 2_000_000_000)
    assert len(node.batches) == 1 and not node.singles
    token = EvmChain(network).token.functions
    assert node.call_data == [
        token.authorizationState(PAYER, NONCE)._encode_transaction_data(),
        token.balanceOf(PAYER)._encode_transaction_data(),
    ]


def test_a_node_that_refuses_batches_is_asked_one_call_each_and_a_used_nonce_is_refused(node):
    network = network_of(node)
    node.batch_status, node.used = 400, word(1)
    state = rail.read_pre_claim_state(network, TERMS)
    assert state.nonce_used and len(node.singles) == 4
    with pytest.raises(DomainError) as refused:
        rail.refuse(network, TERMS, state)
    assert refused.value.code == "NONCE_ALREADY_USED"


def test_a_payer_with_code_is_refused(node):
    network = network_of(node)
    node.code = "0xef0100" + "22" * 20  # an EIP-7702 delegation
    with pytest.raises(DomainError) as refused:
        rail.refuse(network, TERMS, rail.read_pre_claim_state(network, TERMS))
    assert refused.value.code == "PAYER_HAS_CODE"


def _revert(method: str, params: list[Any], in_batch: bool) -> str | None:
    return "execution reverted" if method == "eth_call" else None


def _rate_limit(method: str, params: list[Any], in_batch: bool) -> str | None:
    return "rate limit exceeded" if method == "eth_getCode" else None


@pytest.mark.parametrize(
    "field, value",
    [
        ("fail", _revert),
        ("fail", _rate_limit),
        ("used", "0x"),  # no such view
        ("used", "0x01"),  # short
        ("used", word(2)),  # a bool that is not one
        ("balance", None),
        ("block", None),
        ("block", {"number": None, "timestamp": hex(2_000_000_000)}),
        ("block", {"number": "0x10", "timestamp": None}),
        ("block", {"number": "16", "timestamp": hex(2_000_000_000)}),  # not hex
        ("code", "0xabc"),
        ("batch_status", 500),
    ],
)
def test_an_answer_that_is_not_the_tokens_is_503(node, field, value):
    network = network_of(node)
    setattr(node, field, value)
    with pytest.raises(ChainUnavailable):
        rail.read_pre_claim_state(network, TERMS)
