"""Test wallets injected into the checkout page, each backed by a devnet key held in Python.

``EvmWallet`` is an EIP-1193 provider announced under EIP-6963: the page's requests go through a
Playwright binding to Python, which signs with eth_account and forwards reads to the devnet's
Anvil. Like a real wallet it starts on a chain it alone knows (1), so the page must add and
switch to the intent's chain. ``SolanaWallet`` registers through the Wallet Standard and signs
transactions with a solders keypair. Both record what they were asked and can refuse once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import requests
from eth_account import Account
from eth_account.messages import encode_defunct
from playwright.sync_api import Page
from solders.keypair import Keypair

from payintent import solana_tx as stx

USER_REJECTED = 4001
UNRECOGNIZED_CHAIN = 4902
ICON = "data:image/svg+xml;base64,PHN2ZyB4bWxucz0iaHR0cDovL3d3dy53My5vcmcvMjAwMC9zdmciIHZpZXdCb3g9IjAgMCAxIDEiPjxyZWN0IHdpZHRoPSIxIiBoZWlnaHQ9IjEiIGZpbGw9IiMyNDQ2YzciLz48L3N2Zz4="  # noqa: E501

EVM_PROVIDER_JS = """
(() => {
  const call = async (method, params) => {
    const out = JSON.parse(await window.__e2eEvm(method, JSON.stringify(params ?? [])));
    if (out.error) {
      const error = new Error(out.error.message);
      error.code = out.error.code;
      throw error;
    }
    return out.result;
  };
  const provider = { request: ({ method, params }) => call(method, params), on() {}, removeListener() {} };
  const info = Object.freeze({ uuid: "6f1c1d5e-0000-4000-8000-00000000e2e0", name: "E2E Wallet", icon: "%ICON%",
                               rdns: "dev.payintent.e2e" });
  const announce = () =>
    window.dispatchEvent(new CustomEvent("eip6963:announceProvider", { detail: Object.freeze({ info, provider }) }));
  window.addEventListener("eip6963:requestProvider", announce);
  announce();
})();
""".replace("%ICON%", ICON)

SOLANA_WALLET_JS = """
(() => {
  const fromB64 = (text) => Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
  const toB64 = (bytes) => btoa(String.fromCharCode(...bytes));
  const account = Object.freeze({ address: "%ADDRESS%", publicKey: fromB64("%PUBKEY%"),
    chains: ["solana:localnet", "solana:devnet"], features: ["solana:signTransaction", "solana:signMessage"] });
  const wallet = {
    version: "1.0.0", name: "E2E Solana", icon: "%ICON%", chains: ["solana:localnet", "solana:devnet"], accounts: [],
    features: {
      "standard:connect": { version: "1.0.0", connect: async () => {
        const out = JSON.parse(await window.__e2eSolana("connect", ""));
        if (out.error) throw new Error(out.error.message);
        wallet.accounts = [account];
        return { accounts: wallet.accounts };
      } },
      "standard:events": { version: "1.0.0", on: () => () => {} },
      "solana:signMessage": { version: "1.0.0",
        signMessage: async (...inputs) => Promise.all(inputs.map(async (input) => {
          const out = JSON.parse(await window.__e2eSolana("signMessage", toB64(input.message)));
          if (out.error) throw new Error(out.error.message);
          return { signedMessage: input.message, signature: fromB64(out.result) };
        })) },
      "solana:signTransaction": { version: "1.0.0", supportedTransactionVersions: ["legacy", 0],
        signTransaction: async (...inputs) => Promise.all(inputs.map(async (input) => {
          const out = JSON.parse(await window.__e2eSolana("signTransaction", toB64(input.transaction)));
          if (out.error) throw new Error(out.error.message);
          return { signedTransaction: fromB64(out.result) };
        })) },
    },
  };
  const register = ({ register }) => register(wallet);
  window.dispatchEvent(new CustomEvent("wallet-standard:register-wallet", { detail: register }));
  window.addEventListener("wallet-standard:app-ready", (event) => register(event.detail));
})();
"""


def _error(code: int, message: str) -> str:
    return json.dumps({"error": {"code": code, "message": message}})


@dataclass
class EvmWallet:
    """An EIP-1193 wallet over a devnet private key; ``rpc_urls`` maps chain ids to Anvil URLs."""

    private_key: str
    rpc_urls: dict[int, str]
    chain_id: int = 1
    known_chains: set[int] = field(default_factory=lambda: {1})
    reject_next: set[str] = field(default_factory=set)  # methods to refuse once with 4001
    wrong_key_once: bool = False  # sign the next authorization with another key (settlement refuses it)
    stuck_once: bool = False  # answer the next switch request without switching (as some wallets do)
    requests: list[tuple[str, Any]] = field(default_factory=list)
    typed_data: list[dict[str, Any]] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # what personal_sign signed
    added_chains: list[dict[str, Any]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return Account.from_key(self.private_key).address

    def install(self, page: Page) -> None:
        page.expose_function("__e2eEvm", self.handle)
        page.add_init_script(EVM_PROVIDER_JS)

    def handle(self, method: str, params_json: str) -> str:
        params = json.loads(params_json)
        self.requests.append((method, params))
        if method in self.reject_next:
            self.reject_next.discard(method)
            return _error(USER_REJECTED, "User rejected the request.")
        try:
            return json.dumps({"result": self._answer(method, params)})
        except WalletError as exc:
            return _error(exc.code, str(exc))

    def _answer(self, method: str, params: list[Any]) -> Any:
        if method in ("eth_requestAccounts", "eth_accounts"):
            return [self.address]
        if method == "eth_chainId":
            return hex(self.chain_id)
        if method == "wallet_switchEthereumChain":
            wanted = int(params[0]["chainId"], 16)
            if wanted not in self.known_chains:
                raise WalletError(UNRECOGNIZED_CHAIN, f"Unrecognized chain ID {params[0]['chainId']}.")
            if self.stuck_once:
                self.stuck_once = False
                return None
            self.chain_id = wanted
            return None
        if method == "wallet_addEthereumChain":
            self.added_chains.append(params[0])
            self.known_chains.add(int(params[0]["chainId"], 16))
            return None
        if method == "personal_sign":  # EIP-191: (hex of the message's bytes, account)
            data, signer = params
            if signer.lower() != self.address.lower():
                raise WalletError(4100, "Unknown account")
            text = bytes.fromhex(data[2:]).decode()
            self.messages.append(text)
            return Account.sign_message(encode_defunct(text=text), self.private_key).signature.to_0x_hex()
        if method == "eth_signTypedData_v4":
            signer, data = params
            if signer.lower() != self.address.lower():
                raise WalletError(4100, "Unknown account")
            message = json.loads(data)
            if int(message["domain"]["chainId"]) != self.chain_id:
                raise WalletError(-32000, "Provided chainId does not match the currently active chain")
            self.typed_data.append(message)
            key = self.private_key
            if self.wrong_key_once:
                self.wrong_key_once = False
                key = Account.create().key
            return Account.sign_typed_data(key, full_message=message).signature.to_0x_hex()
        if self.chain_id in self.rpc_urls:  # reads go to the chain, as a wallet's RPC would
            body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
            return requests.post(self.rpc_urls[self.chain_id], json=body, timeout=10).json().get("result")
        raise WalletError(4200, f"{method} is not supported")


class WalletError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class SolanaWallet:
    """A Wallet Standard Solana wallet over a devnet keypair (base58 secret key)."""

    secret_key: str
    reject_next: set[str] = field(default_factory=set)  # "connect" / "signTransaction", refused once
    signed: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # what signMessage signed

    @property
    def keypair(self) -> Keypair:
        return Keypair.from_base58_string(self.secret_key)

    def install(self, page: Page) -> None:
        import base64

        pubkey = base64.b64encode(bytes(self.keypair.pubkey())).decode()
        script = SOLANA_WALLET_JS.replace("%ADDRESS%", str(self.keypair.pubkey())).replace("%PUBKEY%", pubkey)
        page.expose_function("__e2eSolana", self.handle)
        page.add_init_script(script.replace("%ICON%", ICON))

    def handle(self, method: str, argument: str) -> str:
        if method in self.reject_next:
            self.reject_next.discard(method)
            return _error(USER_REJECTED, "User rejected the request.")
        if method == "connect":
            return json.dumps({"result": None})
        if method == "signMessage":
            import base64

            message = base64.b64decode(argument)
            self.messages.append(message.decode())
            return json.dumps({"result": base64.b64encode(bytes(self.keypair.sign_message(message))).decode()})
        tx = stx.sign_as(stx.decode(argument), self.keypair)
        self.signed.append(argument)
        return json.dumps({"result": stx.encode(tx)})
