// The dashboard's wallet code, shared by the refund page (refund.js) and the wallets page (wallet-proof.js): finding
// the browser's wallets (EIP-6963 announcements or window.ethereum on EVM, the Wallet Standard on Solana), switching
// an EVM wallet to a network, and calling the dashboard's JSON routes with the session's CSRF token.
// No third-party code: these files are all the dashboard runs, and only on those two pages.
(() => {
  "use strict";

  const hex = (n) => "0x" + n.toString(16);

  /** The EIP-1193 error code of a rejection (4001: the user declined), looking inside wrappers some wallets add. */
  function providerCode(error) {
    const inner = error && error.data && error.data.originalError ? error.data.originalError.code : undefined;
    if (typeof inner === "number") return inner;
    return error && typeof error.code === "number" ? error.code : null;
  }

  /** EVM wallets: ``render([{name, provider}])`` now and whenever one announces itself. */
  function discoverEvm(render) {
    const found = new Map();
    window.addEventListener("eip6963:announceProvider", (event) => {
      const detail = event.detail;
      if (!detail || !detail.info || !detail.provider) return;
      found.set(detail.info.rdns || detail.info.uuid, { name: String(detail.info.name), provider: detail.provider });
      render([...found.values()]);
    });
    window.dispatchEvent(new Event("eip6963:requestProvider"));
    setTimeout(() => {
      if (!found.size && window.ethereum) found.set("injected", { name: "Browser wallet", provider: window.ethereum });
      render([...found.values()]);
    }, 500);
  }

  /** Solana wallets (Wallet Standard) with ``features``: ``render([{name, wallet}])`` now and as they register. */
  function discoverSolana(features, render) {
    const wallets = [];
    const usable = (w) => w && w.features && features.every((feature) => w.features[feature]);
    const show = () => render(wallets.map((wallet) => ({ name: String(wallet.name), wallet })));
    const register = (...added) => {
      for (const wallet of added) {
        if (usable(wallet) && !wallets.includes(wallet)) wallets.push(wallet);
      }
      show();
      return () => {};
    };
    window.addEventListener("wallet-standard:register-wallet", (event) => event.detail({ register }));
    window.dispatchEvent(new CustomEvent("wallet-standard:app-ready", { detail: { register } }));
    setTimeout(show, 500);
  }

  /** Switch the wallet to ``network`` (as the dashboard describes it), adding it first when the wallet asks (4902). */
  async function ensureChain(provider, network) {
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

  async function evmAccount(provider) {
    const accounts = await provider.request({ method: "eth_requestAccounts" });
    if (!accounts || !accounts[0]) throw new Error("The wallet shared no account.");
    return String(accounts[0]);
  }

  async function solanaAccounts(wallet) {
    const { accounts } = await wallet.features["standard:connect"].connect();
    if (!accounts || !accounts.length) throw new Error("The wallet shared no account.");
    return accounts;
  }

  /** POST ``body`` as JSON to a dashboard route: ``{status, data}``, or an Error with the service's message. */
  async function post(url, csrfToken, body) {
    const response = await fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrfToken },
      body: JSON.stringify(body ?? {}),
    });
    if (response.redirected) throw new Error("Your session has ended: reload the page and log in again.");
    let answer = null;
    try { answer = await response.json(); } catch (_) { /* not JSON: below */ }
    if (!answer || answer.success !== true) {
      const error = answer && answer.error ? answer.error : { message: `The service answered ${response.status}.` };
      throw new Error(String(error.message) + (error.reason ? ` (${error.reason})` : ""));
    }
    return { status: response.status, data: answer.data };
  }

  const fromBase64 = (text) => Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
  const toBase64 = (bytes) => btoa(Array.from(bytes, (b) => String.fromCharCode(b)).join(""));
  const utf8Hex = (text) => "0x" + Array.from(new TextEncoder().encode(text), (b) => b.toString(16).padStart(2, "0")).join("");

  /** A button that runs ``action`` once at a time, reporting a refusal or an error through ``say``. */
  function actionButton(label, say, action, disableAll) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "primary";
    button.textContent = label;
    button.addEventListener("click", async () => {
      disableAll(true);
      try {
        await action();
      } catch (error) {
        say(providerCode(error) === 4001 ? "You declined in the wallet: nothing was signed or sent."
                                         : String((error && error.message) || error));
        disableAll(false);
      }
    });
    return button;
  }

  window.payintentWallets = Object.freeze({
    providerCode, discoverEvm, discoverSolana, ensureChain, evmAccount, solanaAccounts, post, fromBase64, toBase64,
    utf8Hex, actionButton,
  });
})();
