// The refund page's signer: connect the merchant's payout wallet, sign the refund, send it, watch it settle.
// EVM: wallets announced under EIP-6963 (or window.ethereum), an EIP-3009 TransferWithAuthorization signed with
// eth_signTypedData_v4. Solana: Wallet Standard wallets, signing the transaction the service prepared. The page's
// data (the refund's requirement, its network as wallets see it, the routes and the CSRF token) is in
// #refund-signer-data. No third-party code: this file is all the dashboard runs.
(() => {
  "use strict";
  const root = document.getElementById("refund-signer");
  const dataNode = document.getElementById("refund-signer-data");
  if (!root || !dataNode) return;
  const data = JSON.parse(dataNode.textContent);
  const list = document.getElementById("refund-wallets");
  const progress = document.getElementById("refund-progress");
  const statusText = document.getElementById("refund-status-text");
  const kind = data.network.kind;
  let busy = false;
  let done = false; // the refund succeeded or failed: no more buttons

  const say = (text) => { progress.textContent = text; };
  const sameAddress = (a, b) => (kind === "evm" ? a.toLowerCase() === b.toLowerCase() : a === b);

  async function post(url, body) {
    const response = await fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": data.csrf_token },
      body: JSON.stringify(body ?? {}),
    });
    let answer = null;
    try { answer = await response.json(); } catch (_) { /* not JSON: below */ }
    if (!answer || answer.success !== true) {
      const error = answer && answer.error ? answer.error : { message: `The service answered ${response.status}.` };
      throw new Error(error.message + (error.reason ? ` (${error.reason})` : ""));
    }
    return { status: response.status, data: answer.data };
  }

  function show(refund) {
    statusText.textContent = refund.status.replace(/_/g, " ");
    if (refund.status === "succeeded") {
      done = true;
      say(`Refunded: the buyer has the USDC back. Transaction ${refund.tx_hash}.`);
      list.replaceChildren();
      return true;
    }
    if (refund.status === "failed") {
      done = true;
      say(`The refund failed: ${refund.failure_reason || "it could not execute"}.`);
      list.replaceChildren();
      return true;
    }
    say("Sent: the refund is settling on chain\u2026");
    return false;
  }

  async function watch() {
    for (let i = 0; i < 120; i += 1) {
      await new Promise((resolve) => setTimeout(resolve, 2000));
      const response = await fetch(data.status_url, { credentials: "same-origin" });
      const answer = await response.json();
      if (answer.success && show(answer.data)) return;
    }
  }

  async function send(payload) {
    say("Sending the signed refund\u2026");
    const signature = { x402Version: 1, scheme: "exact", network: data.requirement.network, payload };
    const answer = await post(data.pay_url, { payment_signature: signature });
    if (!show(answer.data)) await watch();
  }

  // --- EVM ---------------------------------------------------------------------------------------------------------

  const hex = (n) => "0x" + n.toString(16);
  const providerCode = (error) => {
    const inner = error && error.data && error.data.originalError ? error.data.originalError.code : undefined;
    return typeof inner === "number" ? inner : error && typeof error.code === "number" ? error.code : null;
  };

  async function ensureChain(provider) {
    const network = data.network;
    const wanted = hex(network.chain_id);
    if (String(await provider.request({ method: "eth_chainId" })).toLowerCase() === wanted) return;
    try {
      await provider.request({ method: "wallet_switchEthereumChain", params: [{ chainId: wanted }] });
    } catch (error) {
      if (providerCode(error) !== 4902 || !network.wallet_rpc_url) throw error;
      await provider.request({
        method: "wallet_addEthereumChain",
        params: [{ chainId: wanted, chainName: network.name, rpcUrls: [network.wallet_rpc_url],
                   nativeCurrency: network.native_currency }],
      });
      await provider.request({ method: "wallet_switchEthereumChain", params: [{ chainId: wanted }] });
    }
    if (String(await provider.request({ method: "eth_chainId" })).toLowerCase() !== wanted) {
      throw new Error(`Your wallet is not on ${network.name}.`);
    }
  }

  function nonce() {
    const bytes = crypto.getRandomValues(new Uint8Array(32));
    return "0x" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  async function signEvm(provider) {
    say("Connecting the wallet\u2026");
    const accounts = await provider.request({ method: "eth_requestAccounts" });
    const account = accounts && accounts[0];
    if (!account) throw new Error("The wallet shared no account.");
    if (!sameAddress(account, data.pay_from)) {
      throw new Error(`The wallet shared ${account}; the refund is paid from ${data.pay_from}. Switch to that account.`);
    }
    await ensureChain(provider);
    const requirement = data.requirement;
    const extra = requirement.extra || {};
    const elapsed = Math.floor((Date.now() - loadedAt) / 1000);
    const message = { from: account, to: requirement.payTo, value: requirement.maxAmountRequired, validAfter: "0",
                      validBefore: String(data.now + elapsed + 900), nonce: nonce() };
    const typedData = {
      types: {
        EIP712Domain: [{ name: "name", type: "string" }, { name: "version", type: "string" },
                       { name: "chainId", type: "uint256" }, { name: "verifyingContract", type: "address" }],
        TransferWithAuthorization: [{ name: "from", type: "address" }, { name: "to", type: "address" },
                                    { name: "value", type: "uint256" }, { name: "validAfter", type: "uint256" },
                                    { name: "validBefore", type: "uint256" }, { name: "nonce", type: "bytes32" }],
      },
      primaryType: "TransferWithAuthorization",
      domain: { name: extra.name, version: extra.version, chainId: data.network.chain_id,
                verifyingContract: requirement.asset },
      message,
    };
    say("Approve the refund in your wallet\u2026");
    const signature = await provider.request({ method: "eth_signTypedData_v4",
                                               params: [account, JSON.stringify(typedData)] });
    await send({ ...message, signature });
  }

  function discoverEvm(render) {
    const found = new Map();
    window.addEventListener("eip6963:announceProvider", (event) => {
      const detail = event.detail;
      if (!detail || !detail.info || !detail.provider) return;
      found.set(detail.info.rdns || detail.info.uuid, { name: detail.info.name, sign: () => signEvm(detail.provider) });
      render([...found.values()]);
    });
    window.dispatchEvent(new Event("eip6963:requestProvider"));
    setTimeout(() => {
      if (!found.size && window.ethereum) {
        found.set("injected", { name: "Browser wallet", sign: () => signEvm(window.ethereum) });
      }
      render([...found.values()]);
    }, 500);
  }

  // --- Solana ------------------------------------------------------------------------------------------------------

  const fromBase64 = (text) => Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
  const toBase64 = (bytes) => btoa(Array.from(bytes, (b) => String.fromCharCode(b)).join(""));

  async function signSolana(wallet) {
    say("Connecting the wallet\u2026");
    const { accounts } = await wallet.features["standard:connect"].connect();
    const account = accounts.find((a) => a.address === data.pay_from);
    if (!account) {
      const shared = accounts.map((a) => a.address).join(", ") || "no account";
      throw new Error(`The wallet shared ${shared}; the refund is paid from ${data.pay_from}. Switch to that account.`);
    }
    say("Preparing the transaction\u2026");
    const built = await post(data.transaction_url, {});
    say("Approve the refund in your wallet\u2026");
    const chain = data.network.wallet_chain && account.chains.includes(data.network.wallet_chain)
      ? { chain: data.network.wallet_chain } : {};
    const [output] = await wallet.features["solana:signTransaction"].signTransaction(
      { account, transaction: fromBase64(built.data.transaction), ...chain });
    if (!output || !output.signedTransaction) throw new Error("The wallet returned no signed transaction.");
    await send({ transaction: toBase64(output.signedTransaction) });
  }

  function discoverSolana(render) {
    const wallets = [];
    const usable = (w) => w && w.features && w.features["standard:connect"] && w.features["solana:signTransaction"];
    const register = (...added) => {
      for (const wallet of added) {
        if (usable(wallet) && !wallets.includes(wallet)) wallets.push(wallet);
      }
      render(wallets.map((wallet) => ({ name: wallet.name, sign: () => signSolana(wallet) })));
      return () => {};
    };
    window.addEventListener("wallet-standard:register-wallet", (event) => event.detail({ register }));
    window.dispatchEvent(new CustomEvent("wallet-standard:app-ready", { detail: { register } }));
    setTimeout(() => render(wallets.map((wallet) => ({ name: wallet.name, sign: () => signSolana(wallet) }))), 500);
  }

  // --- the page ----------------------------------------------------------------------------------------------------

  const loadedAt = Date.now();

  function render(wallets) {
    if (busy || done) return;
    if (!wallets.length) {
      const text = document.createElement("p");
      text.textContent = "No wallet found in this browser. Install or unlock one that holds the payout wallet.";
      list.replaceChildren(text);
      return;
    }
    list.replaceChildren(...wallets.map((wallet) => {
      const button = document.createElement("button");
      button.type = "button";
      button.className = "primary";
      button.textContent = `Sign with ${wallet.name}`;
      button.addEventListener("click", async () => {
        if (busy) return;
        busy = true;
        for (const other of list.querySelectorAll("button")) other.disabled = true;
        try {
          await wallet.sign();
        } catch (error) {
          const rejected = providerCode(error) === 4001;
          say(rejected ? "You declined in the wallet: nothing was signed or sent." : String(error.message || error));
          if (!done) for (const other of list.querySelectorAll("button")) other.disabled = false;
        } finally {
          busy = false;
        }
      });
      return button;
    }));
  }

  (kind === "evm" ? discoverEvm : discoverSolana)(render);
})();
