// The hosted checkout: one intent, read from /pay/<intent_id>, paid with a browser wallet.
import "./style.css";
import { ApiError, type CheckoutIntent, type Requirement, type WalletNetwork, getBalance, getIntent, getSolanaTransaction, pay } from "./api";
import { h, replaceChildren } from "./dom";
import { type EvmWallet, connectEvm, discoverEvmWallets, ensureChain, signAuthorization } from "./evm";
import { type Problem, describe } from "./messages";
import { formatSol, formatUsdc } from "./money";
import { qrSvg } from "./qr";
import { type SolanaWallet, connectSolana, discoverSolanaWallets, signSolanaTransaction } from "./solana";
import type { WalletAccount } from "@wallet-standard/base";

type Wallet = EvmWallet | SolanaWallet;
type Phase = "choose" | "connecting" | "ready" | "signing" | "settling" | "paid";

const POLL_MS = 5000;
const REDIRECT_DELAY_MS = 1500;
const app = document.getElementById("app")!;
const intentId = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop() ?? "");

const state = {
  intent: null as CheckoutIntent | null,
  clockOffsetMs: 0, // service clock minus this browser's clock
  network: null as WalletNetwork | null,
  evmWallets: [] as EvmWallet[],
  solanaWallets: [] as SolanaWallet[],
  wallet: null as Wallet | null,
  evmAccount: null as string | null,
  solanaAccount: null as WalletAccount | null,
  balance: null as bigint | null,
  phase: "choose" as Phase,
  timers: [] as number[],
};

// ---------- helpers

const serverNow = () => Date.now() + state.clockOffsetMs;
const merchant = () => state.intent?.merchant_name || "the merchant";
const requirementFor = (network: string): Requirement =>
  state.intent!.payment_requirements.find((r) => r.network === network)!;
const amountText = () => formatUsdc(state.intent!.payment_requirements[0]?.maxAmountRequired ?? "0");
const accountAddress = () => (state.wallet?.kind === "solana" ? state.solanaAccount?.address : state.evmAccount) ?? null;
const short = (address: string) => (address.length > 14 ? `${address.slice(0, 6)}…${address.slice(-4)}` : address);

function returnUrl(intent: CheckoutIntent): string | null {
  if (!intent.redirect_url) return null;
  try {
    const url = new URL(intent.redirect_url);
    url.searchParams.set("intent_id", intent.intent_id);
    return url.toString();
  } catch {
    return null;
  }
}

function txLink(intent: CheckoutIntent, txHash: string, network: string | null): Node {
  const template = intent.networks.find((n) => n.network === network)?.explorer_tx_url;
  const code = h("code", { class: "hash" }, txHash);
  if (!template) return code;
  return h("a", { href: template.replace("{tx}", encodeURIComponent(txHash)), target: "_blank", rel: "noopener noreferrer" }, code);
}

function stopTimers(): void {
  state.timers.forEach((t) => clearInterval(t));
  state.timers = [];
}

let firstPage = true;

function show(title: string, ...content: (Node | null | false)[]): void {
  stopTimers();
  document.title = `${title} · ${merchant()}`;
  app.setAttribute("aria-busy", "false");
  replaceChildren(app, ...content);
  // A page that replaces another (paid, expired…) takes focus so screen readers announce it.
  if (!firstPage) app.querySelector<HTMLElement>("h1")?.focus();
  firstPage = false;
}

function header(): Node {
  return h("header", { class: "merchant" }, h("p", { class: "merchant-name" }, merchant()));
}

// ---------- pages for intents that cannot be paid

function renderOutcome(intent: CheckoutIntent): void {
  const back = (label: string, href: string | null) => href && h("a", { class: "button secondary", href }, label);
  if (intent.status === "paid") {
    show(
      "Paid",
      header(),
      h("section", { class: "outcome paid", "data-state": "paid" },
        h("h1", { tabindex: -1 }, "Paid"),
        h("p", { class: "lead" }, `${amountText()} USDC paid to ${merchant()}.`),
        intent.tx_hash && h("p", { class: "muted" }, "Transaction ", txLink(intent, intent.tx_hash, intent.chain)),
        back(`Return to ${merchant()}`, returnUrl(intent)),
      ),
    );
  } else if (intent.status === "expired") {
    show(
      "Expired",
      header(),
      h("section", { class: "outcome", "data-state": "expired" },
        h("h1", { tabindex: -1 }, "This payment request has expired"),
        h("p", { class: "lead" }, `Nothing was paid. Ask ${merchant()} for a new payment link.`),
        back(`Return to ${merchant()}`, intent.cancel_url),
      ),
    );
  } else {
    show(
      "Cancelled",
      header(),
      h("section", { class: "outcome", "data-state": "cancelled" },
        h("h1", { tabindex: -1 }, "This payment was cancelled"),
        h("p", { class: "lead" }, `${merchant()} cancelled this payment request. Nothing was paid.`),
        back(`Return to ${merchant()}`, intent.cancel_url),
      ),
    );
  }
}

function renderNotFound(): void {
  show(
    "Payment not found",
    h("section", { class: "outcome", "data-state": "not-found" },
      h("h1", { tabindex: -1 }, "Payment not found"),
      h("p", { class: "lead" }, "This link does not lead to a payment. Check the link you were given, or ask the merchant for a new one."),
    ),
  );
}

function renderLoadError(problem: Problem): void {
  show(
    "Cannot load payment",
    h("section", { class: "outcome", "data-state": "load-error" },
      h("h1", { tabindex: -1 }, "The payment cannot be loaded"),
      h("p", { class: "lead" }, `${problem.title}. ${problem.detail}`),
      h("button", { type: "button", class: "button", onclick: () => void load() }, "Try again"),
    ),
  );
}

function renderPaidNow(intent: CheckoutIntent, txHash: string, network: string): void {
  const url = returnUrl(intent);
  show(
    "Payment complete",
    header(),
    h("section", { class: "outcome paid", "data-state": "paid" },
      h("h1", { tabindex: -1 }, "Payment complete"),
      h("p", { class: "lead" }, `${amountText()} USDC paid to ${merchant()}.`),
      h("p", { class: "muted" }, "Transaction ", txLink(intent, txHash, network)),
      url
        ? h("p", { role: "status" }, `Returning you to ${merchant()}… `, h("a", { href: url }, "Continue now"))
        : h("p", { role: "status" }, "You can close this page."),
    ),
  );
  if (url) window.setTimeout(() => location.assign(url), REDIRECT_DELAY_MS);
}

// ---------- the payable page

const ui = {
  countdown: h("time", { class: "countdown" }),
  countdownAnnouncer: h("span", { class: "visually-hidden", "aria-live": "polite" }),
  networks: h("div", { class: "options", role: "radiogroup", "aria-labelledby": "network-label" }),
  wallets: h("div", { class: "wallets" }),
  account: h("div", { class: "account", hidden: true }),
  payButton: h("button", { type: "submit", class: "button pay", disabled: true }),
  steps: h("ol", { class: "steps", "aria-label": "Progress" }),
  progress: h("p", { class: "progress", role: "status", "aria-live": "polite" }),
  problem: h("div", { class: "problem", role: "alert", hidden: true }),
};

function renderPayable(intent: CheckoutIntent): void {
  const checkoutLink = location.href.split("#")[0];
  show(
    `Pay ${amountText()} USDC`,
    header(),
    h("section", { class: "summary", "aria-labelledby": "summary-title" },
      h("h1", { id: "summary-title", tabindex: -1 },
        h("span", { class: "visually-hidden" }, `Pay ${merchant()}: `),
        h("span", { class: "amount", "data-testid": "amount" }, amountText()),
        h("span", { class: "unit" }, " USDC"),
      ),
      intent.description && h("p", { class: "description" }, intent.description),
      h("p", { class: "expiry" }, "Expires in ", ui.countdown, ui.countdownAnnouncer),
    ),
    h("form", { class: "pay-form", novalidate: true, onsubmit: (e: Event) => { e.preventDefault(); void startPayment(); } },
      h("fieldset", {},
        h("legend", { id: "network-label" }, "Network"),
        ui.networks,
      ),
      h("fieldset", {},
        h("legend", {}, "Wallet"),
        ui.wallets,
        ui.account,
      ),
      ui.problem,
      ui.payButton,
      ui.steps,
      ui.progress,
    ),
    h("footer", { class: "links" },
      intent.cancel_url && h("a", { href: intent.cancel_url, class: "cancel" }, `Cancel and return to ${merchant()}`),
      h("details", { class: "qr" },
        h("summary", {}, "Pay from your phone"),
        qrSvg(checkoutLink, "QR code of this checkout page's link"),
        h("p", { class: "muted" }, "Scan with your phone's camera or wallet app to open this checkout there."),
      ),
    ),
  );
  state.network = state.network ?? intent.networks[0] ?? null;
  renderNetworks();
  renderWallets();
  renderAccount();
  renderSteps();
  tickCountdown();
  state.timers.push(window.setInterval(tickCountdown, 1000));
  state.timers.push(window.setInterval(() => void poll(), POLL_MS));
}

function renderNetworks(): void {
  const intent = state.intent!;
  // Built once; later calls update the radios in place so keyboard focus stays where it is.
  if (!ui.networks.childElementCount) {
    replaceChildren(
      ui.networks,
      ...intent.networks.map((network) => {
        const id = `network-${network.network.replace(/[^a-zA-Z0-9]/g, "-")}`;
        return h("label", { class: "option", for: id },
          h("input", { type: "radio", name: "network", id, value: network.network, onchange: () => selectNetwork(network) }),
          h("span", { class: "option-name" }, network.name),
          h("span", { class: "option-hint" }, network.kind === "solana" ? "Solana" : "EVM"),
        );
      }),
    );
  }
  for (const input of ui.networks.querySelectorAll<HTMLInputElement>("input[name=network]")) {
    input.checked = state.network?.network === input.value;
    input.disabled = busy();
  }
}

function walletsFor(network: WalletNetwork | null): Wallet[] {
  if (!network) return [];
  return network.kind === "solana" ? state.solanaWallets : state.evmWallets;
}

function renderWallets(): void {
  const wallets = walletsFor(state.network);
  if (!state.network) {
    replaceChildren(ui.wallets, h("p", { class: "muted" }, "This payment lists no network you can pay on."));
    return;
  }
  if (!wallets.length) {
    const kind = state.network.kind === "solana" ? "a Solana wallet" : "an Ethereum wallet";
    replaceChildren(
      ui.wallets,
      h("p", { class: "muted", "data-testid": "no-wallet" },
        `No wallet found in this browser. Install ${kind} extension and reload, or open this page on your phone (“Pay from your phone” below).`),
    );
    return;
  }
  const focused = (document.activeElement as HTMLElement | null)?.dataset?.wallet;
  replaceChildren(
    ui.wallets,
    ...wallets.map((wallet) => {
      const connected = state.wallet === wallet && accountAddress();
      return h("button", {
          type: "button",
          "data-wallet": wallet.id,
          class: connected ? "wallet connected" : "wallet",
          "aria-pressed": connected ? "true" : "false",
          disabled: busy(),
          onclick: () => void connect(wallet),
        },
        wallet.icon ? h("img", { src: wallet.icon, alt: "", width: 24, height: 24 }) : null,
        h("span", {}, connected ? `${wallet.name} connected` : `Connect ${wallet.name}`),
      );
    }),
  );
  if (focused) ui.wallets.querySelector<HTMLElement>(`[data-wallet="${CSS.escape(focused)}"]`)?.focus();
}

function renderAccount(): void {
  const address = accountAddress();
  const ready = !!address && state.wallet && walletsFor(state.network).includes(state.wallet);
  ui.account.hidden = !ready;
  if (ready) {
    const required = BigInt(requirementFor(state.network!.network).maxAmountRequired);
    const low = state.balance !== null && state.balance < required;
    replaceChildren(
      ui.account,
      h("p", {}, "Account ", h("code", { title: address! }, short(address!))),
      h("p", { class: low ? "balance low" : "balance", "data-testid": "balance" },
        state.balance === null
          ? "Balance: checking…"
          : `Balance on ${state.network!.name}: ${formatUsdc(state.balance)} USDC`),
    );
  }
  ui.payButton.textContent = state.phase === "signing" ? "Waiting for your wallet…"
    : state.phase === "settling" ? "Settling…"
    : `Pay ${amountText()} USDC`;
  ui.payButton.disabled = !ready || busy();
}

const STEPS: [Phase[], string][] = [
  [["choose", "connecting"], "Connect a wallet"],
  [["ready", "signing"], "Approve in your wallet"],
  [["settling"], "Settle on chain"],
  [["paid"], "Paid"],
];

function renderSteps(): void {
  const current = STEPS.findIndex(([phases]) => phases.includes(state.phase));
  replaceChildren(
    ui.steps,
    ...STEPS.map(([, label], index) =>
      h("li", { class: index < current ? "done" : index === current ? "current" : "", "aria-current": index === current ? "step" : null },
        label)),
  );
}

function busy(): boolean {
  return state.phase === "connecting" || state.phase === "signing" || state.phase === "settling" || state.phase === "paid";
}

function setPhase(phase: Phase, progress = ""): void {
  state.phase = phase;
  ui.progress.textContent = progress;
  renderNetworks();
  renderWallets();
  renderAccount();
  renderSteps();
}

function showProblem(problem: Problem | null, retry?: () => void): void {
  ui.problem.hidden = !problem;
  if (!problem) {
    replaceChildren(ui.problem);
    return;
  }
  replaceChildren(
    ui.problem,
    h("h2", { tabindex: -1 }, problem.title),
    h("p", {}, problem.detail),
    retry ? h("button", { type: "button", class: "button secondary", onclick: retry }, "Try again") : null,
  );
}

function tickCountdown(): void {
  const intent = state.intent!;
  const left = Math.max(0, Math.floor((Date.parse(intent.expires_at) - serverNow()) / 1000));
  const minutes = Math.floor(left / 60);
  const text = `${minutes}:${String(left % 60).padStart(2, "0")}`;
  ui.countdown.textContent = text;
  ui.countdown.setAttribute("datetime", `PT${minutes}M${left % 60}S`);
  ui.countdown.classList.toggle("urgent", left < 120);
  if (left === 300 || left === 60) ui.countdownAnnouncer.textContent = ` (${minutes} minute${minutes > 1 ? "s" : ""} left)`;
  if (left === 0 && !busy()) void poll(); // the service says "expired" once it is
}

// ---------- actions

function selectNetwork(network: WalletNetwork): void {
  const kindChanged = state.network?.kind !== network.kind;
  state.network = network;
  state.balance = null;
  showProblem(null);
  if (kindChanged && state.wallet && state.wallet.kind !== network.kind) {
    setPhase("choose");
  } else {
    setPhase(accountAddress() ? "ready" : "choose");
  }
  if (accountAddress() && state.wallet?.kind === network.kind) void refreshBalance();
}

async function connect(wallet: Wallet): Promise<void> {
  showProblem(null);
  setPhase("connecting", `Connecting to ${wallet.name}… Approve the request in your wallet.`);
  try {
    if (wallet.kind === "evm") {
      state.evmAccount = await connectEvm(wallet);
    } else {
      state.solanaAccount = await connectSolana(wallet);
    }
    state.wallet = wallet;
    state.balance = null;
    setPhase("ready", `${wallet.name} connected.`);
    if (await refreshBalance()) ui.payButton.focus(); // the next step
  } catch (error) {
    setPhase("choose");
    showProblem(describe(error, state.network?.name ?? "the network"), () => void connect(wallet));
    focusProblem();
  }
}

/** Read the buyer's USDC balance; true when it covers the payment. */
async function refreshBalance(): Promise<boolean> {
  const network = state.network!;
  const address = accountAddress();
  if (!address) return false;
  try {
    const balance = await getBalance(intentId, network.network, address);
    if (state.network !== network || accountAddress() !== address) return false; // the buyer moved on
    state.balance = BigInt(balance.balance_atomic);
    renderAccount();
    const required = BigInt(balance.required_atomic);
    if (state.balance < required) {
      showProblem(
        {
          title: `Not enough USDC on ${network.name}`,
          detail: `Your balance is ${formatUsdc(state.balance)} USDC and this payment needs ${formatUsdc(required)} USDC. Add USDC to ${short(address)} or choose another network.`,
        },
        () => { showProblem(null); void refreshBalance(); },
      );
      return false;
    }
    showProblem(null);
    return true;
  } catch (error) {
    // The balance is a courtesy: settlement checks it again, so a failed read does not block paying.
    state.balance = null;
    renderAccount();
    if (error instanceof ApiError && error.code === "NOT_FOUND") void load();
    return true;
  }
}

async function startPayment(): Promise<void> {
  const intent = state.intent!;
  const network = state.network;
  const wallet = state.wallet;
  if (!network || !wallet || busy() || !accountAddress()) return;
  showProblem(null);
  try {
    setPhase("signing", "Checking your balance…");
    if (!(await refreshBalance())) {
      setPhase("ready");
      focusProblem();
      return;
    }
    const requirement = requirementFor(network.network);
    let payload: Record<string, string>;
    if (wallet.kind === "evm") {
      setPhase("signing", `Switching your wallet to ${network.name}…`);
      await ensureChain(wallet, network);
      setPhase("signing", `Approve the payment of ${amountText()} USDC in ${wallet.name}.`);
      payload = await signAuthorization(wallet, state.evmAccount!, requirement, network.chain_id!, Math.floor(serverNow() / 1000));
    } else {
      setPhase("signing", "Preparing the transaction…");
      const unsigned = await getSolanaTransaction(intentId, network.network, state.solanaAccount!.address);
      // The first payment to the shop's USDC account opens it, and the buyer pays its rent: say so before signing.
      const rent = unsigned.creates_payee_account ? ` It also opens the shop's USDC account, which costs you ${formatSol(unsigned.payer_pays_lamports)} SOL of rent.` : "";
      setPhase("signing", `Approve the payment of ${amountText()} USDC in ${wallet.name}.${rent}`);
      payload = { transaction: await signSolanaTransaction(wallet, state.solanaAccount!, unsigned.transaction, network.wallet_chain) };
    }
    setPhase("settling", `Settling on ${network.name}… This usually takes a few seconds; keep this page open.`);
    const result = await pay(intentId, { x402Version: 1, scheme: "exact", network: network.network, payload });
    setPhase("paid", "Paid.");
    renderPaidNow(intent, result.tx_hash, result.network);
  } catch (error) {
    const problem = describe(error, network.name);
    if (problem.reload) {
      setPhase("settling", problem.detail);
      await waitForOutcome(problem);
      return;
    }
    setPhase("ready");
    showProblem(problem, () => { showProblem(null); void startPayment(); });
    focusProblem();
  }
}

/** After "in progress" or "still settling", follow the intent until it is paid or can be paid again. */
async function waitForOutcome(problem: Problem): Promise<void> {
  for (let i = 0; i < 60; i++) {
    try {
      const intent = await getIntent(intentId);
      state.intent = intent;
      if (intent.status === "paid") {
        setPhase("paid", "Paid.");
        renderPaidNow(intent, intent.tx_hash ?? "", intent.chain ?? "");
        return;
      }
      if (intent.status !== "pending") {
        renderOutcome(intent);
        return;
      }
      if (!problem.wait) break;
    } catch (error) {
      if (error instanceof ApiError && error.status === 404) {
        renderNotFound();
        return;
      }
      // otherwise keep waiting through a blip
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
  setPhase("ready");
  showProblem(problem, () => { showProblem(null); void startPayment(); });
  focusProblem();
}

function focusProblem(): void {
  ui.problem.querySelector<HTMLElement>("h2")?.focus();
}

async function poll(): Promise<void> {
  if (busy() || document.hidden) return;
  try {
    const intent = await getIntent(intentId);
    state.clockOffsetMs = Date.parse(intent.server_time) - Date.now();
    state.intent = intent;
    if (intent.status !== "pending" && !busy()) renderOutcome(intent);
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) renderNotFound();
  }
}

async function load(): Promise<void> {
  app.setAttribute("aria-busy", "true");
  try {
    const intent = await getIntent(intentId);
    state.intent = intent;
    state.clockOffsetMs = Date.parse(intent.server_time) - Date.now();
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) renderNotFound();
    else renderLoadError(describe(error, "the network"));
    return;
  }
  if (state.intent.status !== "pending") {
    renderOutcome(state.intent);
    return;
  }
  renderPayable(state.intent);
}

// Wallets announce themselves at any time: keep the list current.
state.evmWallets = discoverEvmWallets((wallets) => {
  state.evmWallets = wallets;
  if (state.intent?.status === "pending") renderWallets();
});
state.solanaWallets = discoverSolanaWallets((wallets) => {
  state.solanaWallets = wallets;
  if (state.intent?.status === "pending") renderWallets();
});
void load();
