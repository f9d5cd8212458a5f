// The wallets page: register a payout wallet by connecting it and signing the service's message (it names the
// merchant and the network, and moves no funds): EIP-191 personal_sign on EVM, signMessage on Solana. Each network's
// card has a .wallet-connect block (data-network, data-kind, data-name); wallets.js finds the wallets.
(() => {
  "use strict";
  const W = window.payintentWallets;
  const config = document.getElementById("wallet-proof-data");
  // Only on the wallets page (or its form's answer): nowhere else does this script ask a wallet for anything.
  if (!W || !config || window.location.pathname !== "/dashboard/wallets") return;
  const { challenge_url: challengeUrl, prove_url: proveUrl, csrf_token: csrfToken } = JSON.parse(config.textContent);

  for (const block of document.querySelectorAll(".wallet-connect")) {
    const network = block.dataset.network;
    const name = block.dataset.name;
    const list = block.querySelector(".wallet-buttons");
    const progress = block.querySelector(".wallet-progress");
    const say = (text) => { progress.textContent = text; };
    let busy = false;

    async function prove(address, sign) {
      say("Asking the service for the message to sign\u2026");
      const issued = await W.post(challengeUrl, csrfToken, { network, address });
      say("Sign the message in your wallet (it moves no funds)\u2026");
      const signature = await sign(issued.data.message);
      say("Checking the signature\u2026");
      await W.post(proveUrl, csrfToken, { network, address, signature });
      say("Verified. Reloading\u2026");
      window.location.reload();
    }

    async function connectEvm(provider) {
      say("Connecting the wallet\u2026");
      const account = await W.evmAccount(provider);
      await prove(account, (message) => provider.request({ method: "personal_sign",
                                                          params: [W.utf8Hex(message), account] }));
    }

    async function connectSolana(wallet) {
      say("Connecting the wallet\u2026");
      const [account] = await W.solanaAccounts(wallet);
      await prove(account.address, async (message) => {
        const [output] = await wallet.features["solana:signMessage"].signMessage(
          { account, message: new TextEncoder().encode(message) });
        if (!output || !output.signature) throw new Error("The wallet returned no signature.");
        return W.toBase64(output.signature);
      });
    }

    const disableAll = (disabled) => {
      busy = disabled;
      for (const button of list.querySelectorAll("button")) button.disabled = disabled;
    };

    const render = (wallets) => {
      if (busy) return;
      if (!wallets.length) {
        const text = document.createElement("p");
        text.className = "muted";
        text.textContent = "No wallet found in this browser: install or unlock one, or paste the address below.";
        list.replaceChildren(text);
        return;
      }
      list.replaceChildren(...wallets.map((found) => W.actionButton(
        `Connect ${found.name} on ${name}`, say,
        () => (found.provider ? connectEvm(found.provider) : connectSolana(found.wallet)), disableAll)));
    };

    if (block.dataset.kind === "evm") W.discoverEvm(render);
    else W.discoverSolana(["standard:connect", "solana:signMessage"], render);
  }
})();
