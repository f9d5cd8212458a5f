// EVM wallets: EIP-6963 discovery of injected EIP-1193 providers, chain switching, EIP-3009 signing.
import type { Requirement, WalletNetwork } from "./api";

export interface Eip1193Provider {
  request(args: { method: string; params?: unknown[] | object }): Promise<unknown>;
}

export interface EvmWallet {
  kind: "evm";
  id: string; // EIP-6963 rdns, or "injected" for a bare window.ethereum
  name: string;
  icon: string | null;
  provider: Eip1193Provider;
}

interface ProviderDetail {
  info: { uuid: string; name: string; icon: string; rdns: string };
  provider: Eip1193Provider;
}

/** Wallets announced under EIP-6963, plus window.ethereum when no wallet announces itself. */
export function discoverEvmWallets(onChange: (wallets: EvmWallet[]) => void): EvmWallet[] {
  const byId = new Map<string, EvmWallet>();
  const list = () => {
    const wallets = [...byId.values()];
    const injected = (window as unknown as { ethereum?: Eip1193Provider }).ethereum;
    if (!wallets.length && injected) {
      wallets.push({ kind: "evm", id: "injected", name: "Browser wallet", icon: null, provider: injected });
    }
    return wallets;
  };
  window.addEventListener("eip6963:announceProvider", (event: Event) => {
    const detail = (event as CustomEvent<ProviderDetail>).detail;
    if (!detail?.info || !detail.provider) return;
    const icon = /^data:image\//.test(detail.info.icon) ? detail.info.icon : null;
    byId.set(detail.info.rdns || detail.info.uuid, {
      kind: "evm",
      id: detail.info.rdns || detail.info.uuid,
      name: detail.info.name,
      icon,
      provider: detail.provider,
    });
    onChange(list());
  });
  window.dispatchEvent(new Event("eip6963:requestProvider"));
  return list();
}

/** The EIP-1193 error code of a rejection, looking inside wrappers some wallets add. */
export function providerErrorCode(error: unknown): number | null {
  const e = error as { code?: unknown; data?: { originalError?: { code?: unknown } } } | null;
  const inner = e?.data?.originalError?.code;
  if (typeof inner === "number") return inner;
  return typeof e?.code === "number" ? e.code : null;
}

export async function connectEvm(wallet: EvmWallet): Promise<string> {
  const accounts = (await wallet.provider.request({ method: "eth_requestAccounts" })) as string[];
  if (!accounts?.length) throw new Error("The wallet shared no account.");
  return accounts[0];
}

const hexChainId = (chainId: number) => "0x" + chainId.toString(16);

/** Switch the wallet to the network, adding it first when the wallet does not know it (4902). */
export async function ensureChain(wallet: EvmWallet, network: WalletNetwork): Promise<void> {
  const wanted = hexChainId(network.chain_id!);
  const current = String(await wallet.provider.request({ method: "eth_chainId" }));
  if (current.toLowerCase() === wanted) return;
  try {
    await wallet.provider.request({ method: "wallet_switchEthereumChain", params: [{ chainId: wanted }] });
  } catch (error) {
    if (providerErrorCode(error) !== 4902) throw error;
    if (!network.wallet_rpc_url) throw new UnknownChainError(network.name);
    await wallet.provider.request({
      method: "wallet_addEthereumChain",
      params: [
        {
          chainId: wanted,
          chainName: network.name,
          rpcUrls: [network.wallet_rpc_url],
          nativeCurrency: network.native_currency ?? { name: "Ether", symbol: "ETH", decimals: 18 },
          ...(network.explorer_tx_url ? { blockExplorerUrls: [new URL(network.explorer_tx_url).origin] } : {}),
        },
      ],
    });
    await wallet.provider.request({ method: "wallet_switchEthereumChain", params: [{ chainId: wanted }] });
  }
  const now = String(await wallet.provider.request({ method: "eth_chainId" }));
  if (now.toLowerCase() !== wanted) throw new WrongChainError(network.name);
}

export class UnknownChainError extends Error {
  constructor(readonly networkName: string) {
    super(`Your wallet does not know ${networkName}.`);
  }
}

export class WrongChainError extends Error {
  constructor(readonly networkName: string) {
    super(`Your wallet is not on ${networkName}.`);
  }
}

function randomNonce(): string {
  const bytes = crypto.getRandomValues(new Uint8Array(32));
  return "0x" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/**
 * Ask the wallet to sign an EIP-3009 TransferWithAuthorization paying exactly the requirement.
 * The domain name is the requirement's own (tokens differ: "USDC", "USD Coin"); the nonce is fresh
 * and random; validBefore is 15 minutes from now by the service's clock.
 */
export async function signAuthorization(
  wallet: EvmWallet,
  account: string,
  requirement: Requirement,
  chainId: number,
  nowSeconds: number,
): Promise<Record<string, string>> {
  const message = {
    from: account,
    to: requirement.payTo,
    value: requirement.maxAmountRequired,
    validAfter: "0",
    validBefore: String(nowSeconds + 900),
    nonce: randomNonce(),
  };
  const typedData = {
    types: {
      EIP712Domain: [
        { name: "name", type: "string" },
        { name: "version", type: "string" },
        { name: "chainId", type: "uint256" },
        { name: "verifyingContract", type: "address" },
      ],
      TransferWithAuthorization: [
        { name: "from", type: "address" },
        { name: "to", type: "address" },
        { name: "value", type: "uint256" },
        { name: "validAfter", type: "uint256" },
        { name: "validBefore", type: "uint256" },
        { name: "nonce", type: "bytes32" },
      ],
    },
    primaryType: "TransferWithAuthorization",
    domain: {
      name: requirement.extra.name,
      version: requirement.extra.version ?? "2",
      chainId,
      verifyingContract: requirement.asset,
    },
    message,
  };
  const signature = (await wallet.provider.request({
    method: "eth_signTypedData_v4",
    params: [account, JSON.stringify(typedData)],
  })) as string;
  return { ...message, signature };
}
