// An agent written with the public npm x402 client (@x402/fetch's wrapFetchWithPayment over
// @x402/core + @x402/evm, viem as the signer) buying one URL, for test_paywall_interop.py.
//
// stdin:  {"url": "...", "privateKey": "0x…", "allowedAssets": [{"network", "asset"}, ...]}
// stdout: {"status", "body", "paymentResponse"}: the final answer and its decoded PAYMENT-RESPONSE.
import { readFileSync } from "node:fs";
import { privateKeyToAccount } from "viem/accounts";
import { decodePaymentResponseHeader, wrapFetchWithPayment, x402Client } from "@x402/fetch";
import { registerExactEvmScheme } from "@x402/evm/exact/client";

const { url, privateKey, allowedAssets } = JSON.parse(readFileSync(0, "utf8"));
const client = new x402Client();
registerExactEvmScheme(client, { signer: privateKeyToAccount(privateKey) });
// The library's defaults know only Circle's USDC: an agent allows the devnet's token explicitly.
client.setSpendControls({ allowedAssets });
const response = await wrapFetchWithPayment(fetch, client)(url);
const header = response.headers.get("PAYMENT-RESPONSE") ?? response.headers.get("X-PAYMENT-RESPONSE");
const body = await response.text();
const paymentResponse = header ? decodePaymentResponseHeader(header) : null;
process.stdout.write(JSON.stringify({ status: response.status, body, paymentResponse }) + "\n");
