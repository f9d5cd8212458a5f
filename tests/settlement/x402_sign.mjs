// Sign an x402 payment the way the public npm libraries do (@x402/core's client with @x402/evm's
// exact scheme, viem as the signer), for the interop tests in test_x402_interop.py. Offline.
//
// stdin:  {"paymentRequired": {x402Version, accepts: [...], resource?}, "privateKey": "0x…",
//          "spendControls"?: false | {...}}
// stdout: the PaymentPayload the client sends (the JSON its PAYMENT-SIGNATURE / X-PAYMENT header
//         encodes), exactly as the library built it.
//
// Without "spendControls", every accepts entry's asset is allowed, uncapped: the libraries refuse
// assets they do not know (ours on the devnet) unless the client opts in, as a real client would.
import { readFileSync } from "node:fs";
import { privateKeyToAccount } from "viem/accounts";
import { x402Client, x402HTTPClient } from "@x402/core/client";
import { registerExactEvmScheme } from "@x402/evm/exact/client";

const input = JSON.parse(readFileSync(0, "utf8"));
const { paymentRequired, privateKey } = input;
const spendControls =
  input.spendControls !== undefined
    ? input.spendControls
    : { allowedAssets: paymentRequired.accepts.map(({ network, asset }) => ({ network, asset })) };

const client = new x402Client();
registerExactEvmScheme(client, { signer: privateKeyToAccount(privateKey) });
client.setSpendControls(spendControls);
const payload = await client.createPaymentPayload(paymentRequired);

// The header the HTTP client would send, decoded again: proves the JSON below is what goes on the wire.
const headers = new x402HTTPClient(client).encodePaymentSignatureHeader(payload);
const [name, value] = Object.entries(headers)[0];
const onTheWire = JSON.parse(Buffer.from(value, "base64").toString("utf8"));
process.stdout.write(JSON.stringify({ header: name, payload: onTheWire }) + "\n");
