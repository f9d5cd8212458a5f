// A merchant's own Express server selling GET /weather with the official npm middleware (@x402/express), whose
// facilitator is payintent's API (@x402/core's HTTPFacilitatorClient with the merchant's key as a header), for
// test_facilitator_interop.py. Unchanged library code; only its configuration is ours.
//
// stdin:  {"facilitatorUrl", "apiKey", "network", "payTo", "amount", "asset", "extra": {name, version}}
// stdout: one line "listening <port>" once it serves (127.0.0.1, a free port); then one line per served request.
import { readFileSync } from "node:fs";
import express from "express";
import { paymentMiddleware, x402ResourceServer } from "@x402/express";
import { HTTPFacilitatorClient } from "@x402/core/server";
import { ExactEvmScheme } from "@x402/evm/exact/server";

const config = JSON.parse(readFileSync(0, "utf8"));
const auth = { Authorization: `Bearer ${config.apiKey}` };
const facilitator = new HTTPFacilitatorClient({
  url: config.facilitatorUrl,
  createAuthHeaders: async () => ({ verify: auth, settle: auth, supported: auth }),
});
const server = new x402ResourceServer(facilitator).register(config.network, new ExactEvmScheme());
const routes = {
  "GET /weather": {
    accepts: {
      scheme: "exact",
      network: config.network,
      payTo: config.payTo,
      price: { amount: config.amount, asset: config.asset, extra: config.extra },
    },
    description: "The weather, now",
    mimeType: "application/json",
  },
};
const app = express();
app.use(paymentMiddleware(routes, server));
app.get("/weather", (req, res) => {
  process.stdout.write("served /weather\n");
  res.json({ forecast: "sunny" });
});
const listener = app.listen(0, "127.0.0.1", () => {
  process.stdout.write(`listening ${listener.address().port}\n`);
});
