// The refund page's signer: connect the merchant's payout wallet, sign the refund, send it, watch it settle.
// EVM: an EIP-3009 TransferWithAuthorization of exactly the refund, signed with eth_signTypedData_v4. Solana: the
// transaction the service prepared, signed by the wallet. The page's data (the refund's requirement, its network
// as wallets see it, the routes and the CSRF token) is in #refund-signer-data; wallets.js finds the wallets.
(() => {
  "use strict";
  const W = window.payintentWallets;
  const dataNode = document.getElementById("refund-signer-data");
  // Only on a refund's own page: nowhere else does this script ask a wallet for anything.
  if (!W || !dataNode || !/^\/dashboard\/refunds\/re_[0-9a-f]{32}$/.test(window.location.pathname)) return;
  const data = JSON.parse(dataNode.textContent);
  const list = document.getElementById("refund-wallets");
  const progress = document.getElementById("refund-progress");
  const statusText = document.getElementById("refund-status-text");
  const loadedAt = Date.now();
  let busy = false;
  let done = false; // the refund succeeded or failed: no more buttons

  const say = (text) => { progress.textContent = text; };
  const post = (url, body) => W.post(url, data.csrf_token, body);

  function show(refund) {
    statusText.textContent = refund.status.replace(/_/g, " ");
    if (refund.status === "succeeded" || refund.status === "failed") {
      done = true;
      list.replaceChildren();
      say(refund.status === "succeeded"
        ? `Refunded: the buyer has the USDC back. Transaction ${refund.tx_hash}.`
        : `The refund failed: ${refund.failure_reason || "it could not execute"}.`);
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
    let answer;
    try {
      answer = await post(data.pay_url, { payment_signature: signature });
    } catch (error) {
      // Whatever went wrong, this signature was sent: never offer to sign again on this page (a refund is paid
      // once); the refund's status says what happened.
      done = true;
      list.replaceChildren();
      const now = await fetch(data.status_url, { credentials: "same-origin" }).then((r) => r.json()).catch(() => null);
      if (now && now.success && now.data.status !== "requires_signature") show(now.data);
      say(`${String(error.message || error)} Reload the page to see the refund.`);
      return;
    }
    if (!show(answer.data)) await watch();
  }

  function nonce() {
    const bytes = crypto.getRandomValues(new Uint8Array(32));
    return "0x" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  async function signEvm(provider) {
    say("Connecting the wallet\u2026");
    const account = await W.evmAccount(provider);
    if (account.toLowerCase() !== data.pay_from.toLowerCase()) {
      throw new Error(`The wallet shared ${account}; the refund is paid from ${data.pay_from}. Switch to that account.`);
    }
    await W.ensureChain(provider, data.network);
    const requirement = data.requirement;
    if (requirement.payTo.toLowerCase() !== data.pay_to.toLowerCase() || requirement.maxAmountRequired !== data.amount_atomic) {
      throw new Error("The refund's terms on this page do not match: reload the page.");
    }
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

  async function signSolana(wallet) {
    say("Connecting the wallet\u2026");
    const accounts = await W.solanaAccounts(wallet);
    const account = accounts.find((a) => a.address === data.pay_from);
    if (!account) {
      const shared = accounts.map((a) => a.address).join(", ");
      throw new Error(`The wallet shared ${shared}; the refund is paid from ${data.pay_from}. Switch to that account.`);
    }
    say("Preparing the transaction\u2026");
    const built = await post(data.transaction_url, {});
    if (built.data.payer !== data.pay_from) throw new Error("The prepared transaction is not from the payout wallet.");
    const rent = built.data.creates_payee_account ? Number(built.data.payer_pays_lamports) / 1e9 : 0;
    say(rent ? `Approve the refund in your wallet: it also opens the buyer's USDC account, your wallet paying its rent `
               + `of ${rent} SOL\u2026` : "Approve the refund in your wallet\u2026");
    const chain = data.network.wallet_chain && account.chains.includes(data.network.wallet_chain)
      ? { chain: data.network.wallet_chain } : {};
    const [output] = await wallet.features["solana:signTransaction"].signTransaction(
      { account, transaction: W.fromBase64(built.data.transaction), ...chain });
    if (!output || !output.signedTransaction) throw new Error("The wallet returned no signed transaction.");
    await send({ transaction: W.toBase64(output.signedTransaction) });
  }

  const disableAll = (disabled) => {
    busy = disabled;
    if (!done) for (const button of list.querySelectorAll("button")) button.disabled = disabled;
  };

  function render(wallets) {
    if (busy || done) return;
    if (!wallets.length) {
      const text = document.createElement("p");
      text.textContent = "No wallet found in this browser. Install or unlock one that holds the payout wallet.";
      list.replaceChildren(text);
      return;
    }
    list.replaceChildren(...wallets.map((found) => W.actionButton(
      `Sign with ${found.name}`, say,
      () => (found.provider ? signEvm(found.provider) : signSolana(found.wallet)), disableAll)));
  }

  if (data.network.kind === "evm") W.discoverEvm(render);
  else W.discoverSolana(["standard:connect", "solana:signTransaction"], render);
})();
