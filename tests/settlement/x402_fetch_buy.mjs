// A buyer with the official npm client (@x402/fetch's wrapFetchWithPayment, @x402/evm's exact scheme, viem as the
// signer): GET the URL, paying its 402, for test_facilitator_interop.py.
//
// stdin:  {"url", "privateKey", "network", "asset"}
// stdout: {"status", "body", "paymentResponse"}: the final answer, and its PAYMENT-RESPONSE header decoded.
import { readFileSync } from "node:fs";
import { privateKeyToAccount } from "viem/accounts";
import { decodePaymentResponseHeader, wrapFetchWithPayment, x402Client } from "@x402/fetch";
import { registerExactEvmScheme } from "@x402/evm/exact/client";

const input = JSON.parse(readFileSync(0, "utf8"));
const client = new x402Client();
registerExactEvmScheme(client, { signer: privateKeyToAccount(input.privateKey) });
// The libraries allow only the assets they know (Circle's USDC): opt in to the devnet's, as a real client would.
client.setSpendControls({ allowedAssets: [{ network: input.network, asset: input.asset }] });
const paying = wrapFetchWithPayment(fetch, client);
const response = await paying(input.url);
const header = response.headers.get("PAYMENT-RESPONSE") || response.headers.get("X-PAYMENT-RESPONSE");
const body = await response.text();
process.stdout.write(
  JSON.stringify({
    status: response.status,
    body,
    paymentResponse: header ? decodePaymentResponseHeader(header) : null,
  }) + "\n",
);
