// The public checkout API (no key, one intent): see /api/v1/docs, tag "checkout".

export interface Requirement {
  scheme: string;
  network: string;
  maxAmountRequired: string; // atomic units (6 decimals)
  payTo: string;
  asset: string;
  maxTimeoutSeconds: number;
  extra: { name?: string; version?: string; decimals?: number; feePayer?: string };
}

export interface WalletNetwork {
  network: string;
  name: string;
  kind: "evm" | "solana";
  chain_id: number | null;
  wallet_rpc_url: string | null;
  native_currency: { name: string; symbol: string; decimals: number } | null;
  wallet_chain: string | null;
  explorer_tx_url: string | null;
}

export type Status = "pending" | "paid" | "expired" | "cancelled";

export interface CheckoutIntent {
  intent_id: string;
  status: Status;
  merchant_name: string | null;
  description: string | null;
  expires_at: string;
  redirect_url: string | null;
  cancel_url: string | null;
  payment_requirements: Requirement[];
  networks: WalletNetwork[];
  tx_hash: string | null;
  chain: string | null;
  server_time: string;
}

export interface Balance {
  network: string;
  address: string;
  balance_atomic: string;
  required_atomic: string;
}

export interface PaymentResult {
  tx_hash: string;
  network: string;
  intent_id: string;
}

export interface SolanaTransaction {
  transaction: string; // base64, unsigned by the buyer
  network: string;
  creates_payee_account: boolean; // it opens the merchant's USDC account ...
  payer_pays_lamports: number; // ... and the buyer pays this rent (0 otherwise)
}

/** An error answered by the service ({success:false,error:{code,message}}) or a failed request. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly retryAfter: number | null = null,
  ) {
    super(message);
  }
}

async function call<T>(method: "GET" | "POST", path: string, body?: unknown): Promise<T> {
  let response: Response;
  try {
    response = await fetch(`/api/v1/checkout${path}`, {
      method,
      headers: body === undefined ? { Accept: "application/json" } : { "Content-Type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit",
      cache: "no-store",
    });
  } catch {
    throw new ApiError(0, "NETWORK_ERROR", "The payment service cannot be reached. Check your connection.");
  }
  let parsed: { success?: boolean; data?: T; error?: { code: string; message: string } } = {};
  try {
    parsed = await response.json();
  } catch {
    // a proxy's HTML error page: reported below by status
  }
  if (response.ok && parsed.success && parsed.data !== undefined) return parsed.data;
  const retry = Number(response.headers.get("Retry-After"));
  throw new ApiError(
    response.status,
    parsed.error?.code ?? "HTTP_" + response.status,
    parsed.error?.message ?? `The payment service answered ${response.status}.`,
    Number.isFinite(retry) && retry > 0 ? retry : null,
  );
}

const base = (id: string) => `/intents/${encodeURIComponent(id)}`;

export const getIntent = (id: string) => call<CheckoutIntent>("GET", base(id));

export const getBalance = (id: string, network: string, address: string) =>
  call<Balance>(
    "GET",
    `${base(id)}/balance?network=${encodeURIComponent(network)}&address=${encodeURIComponent(address)}`,
  );

export const getSolanaTransaction = (id: string, network: string, payer: string) =>
  call<SolanaTransaction>("POST", `${base(id)}/solana-transaction`, { network, payer });

export const pay = (id: string, paymentSignature: unknown) =>
  call<PaymentResult>("POST", `${base(id)}/pay`, { payment_signature: paymentSignature });
