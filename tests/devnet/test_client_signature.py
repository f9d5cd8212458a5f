"""A signature from payintent.eip3009 is one the real token contract executes."""

from __future__ import annotations

from web3 import Web3

from payintent.eip3009 import sign_authorization
from tests.devnet.chain import USDC, send


def test_client_signature_executes_on_the_token(w3: Web3, token, accounts) -> None:
    requirement = {
        "network": f"eip155:{w3.eth.chain_id}",
        "asset": token.address,
        "payTo": accounts.payee.address,
        "maxAmountRequired": str(25 * USDC),
        "usdcDomainName": token.functions.name().call(),
        "extra": {"version": "2"},
    }
    now = w3.eth.get_block("latest")["timestamp"]
    payload = sign_authorization(accounts.buyer.key, requirement, now=now)
    before = token.functions.balanceOf(accounts.payee.address).call()
    transfer = token.get_function_by_signature(
        "transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,bytes)"
    )
    call = transfer(
        payload["from"], payload["to"], int(payload["value"]), int(payload["validAfter"]),
        int(payload["validBefore"]), bytes.fromhex(payload["nonce"][2:]), bytes.fromhex(payload["signature"][2:]),
    )  # fmt: skip
    assert send(w3, accounts.relayer, call)["status"] == 1
    assert token.functions.balanceOf(accounts.payee.address).call() - before == 25 * USDC
    assert token.functions.authorizationState(payload["from"], bytes.fromhex(payload["nonce"][2:])).call()
