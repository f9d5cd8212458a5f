// Solana wallets through the Wallet Standard: connect, then sign (not send) the service's transaction.
import { getWallets } from "@wallet-standard/app";
import type { Wallet, WalletAccount } from "@wallet-standard/base";

export interface SolanaWallet {
  kind: "solana";
  id: string;
  name: string;
  icon: string | null;
  wallet: Wallet;
}

const CONNECT = "standard:connect";
const SIGN_TRANSACTION = "solana:signTransaction";

interface ConnectFeature {
  connect(input?: { silent?: boolean }): Promise<{ accounts: readonly WalletAccount[] }>;
}

interface SignTransactionFeature {
  signTransaction(
    ...inputs: { account: WalletAccount; transaction: Uint8Array; chain?: string }[]
  ): Promise<readonly { signedTransaction: Uint8Array }[]>;
}

const canPay = (wallet: Wallet) =>
  CONNECT in wallet.features &&
  SIGN_TRANSACTION in wallet.features &&
  wallet.chains.some((chain) => chain.startsWith("solana:"));

/** Registered Wallet Standard wallets that can sign Solana transactions (now and as they register). */
export function discoverSolanaWallets(onChange: (wallets: SolanaWallet[]) => void): SolanaWallet[] {
  const registry = getWallets();
  const list = () =>
    registry
      .get()
      .filter(canPay)
      .map((wallet) => ({ kind: "solana" as const, id: wallet.name, name: wallet.name, icon: wallet.icon ?? null, wallet }));
  registry.on("register", () => onChange(list()));
  registry.on("unregister", () => onChange(list()));
  return list();
}

export async function connectSolana(wallet: SolanaWallet): Promise<WalletAccount> {
  const { accounts } = await (wallet.wallet.features[CONNECT] as ConnectFeature).connect();
  const account = accounts.find((a) => a.chains.some((c) => c.startsWith("solana:"))) ?? accounts[0];
  if (!account) throw new Error("The wallet shared no account.");
  return account;
}

export function fromBase64(text: string): Uint8Array {
  return Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
}

export function toBase64(bytes: Uint8Array): string {
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary);
}

/** Have the wallet add the buyer's signature; the relay co-signs and submits at /pay. */
export async function signSolanaTransaction(
  wallet: SolanaWallet,
  account: WalletAccount,
  transactionBase64: string,
  walletChain: string | null,
): Promise<string> {
  const feature = wallet.wallet.features[SIGN_TRANSACTION] as SignTransactionFeature;
  const chain = walletChain && account.chains.includes(walletChain as `${string}:${string}`) ? walletChain : undefined;
  const [output] = await feature.signTransaction({
    account,
    transaction: fromBase64(transactionBase64),
    ...(chain ? { chain } : {}),
  });
  if (!output?.signedTransaction) throw new Error("The wallet returned no signed transaction.");
  return toBase64(output.signedTransaction);
}
