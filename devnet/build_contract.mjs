#!/usr/bin/env node
// Compile devnet/contracts/TestUSDC.sol with the npm `solc` package and write devnet/artifacts/TestUSDC.json.
//
//   node devnet/build_contract.mjs           (re)write the artifact
//   node devnet/build_contract.mjs --check   exit 1 if the committed artifact differs from a fresh build
//
// Runs offline: imports are read from node_modules only (install them with `npm ci`). The output is
// deterministic (same sources + same locked packages => byte-identical artifact), so the artifact is
// committed and Python needs no Node at run time. `source.sha256` lets Python detect a stale artifact.

import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const require = createRequire(import.meta.url);
const solc = require("solc");

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const NODE_MODULES = path.join(ROOT, "node_modules");
const CONTRACT = "TestUSDC";
const SOURCE = `devnet/contracts/${CONTRACT}.sol`; // source unit name, relative to the repo root
const ARTIFACT = path.join(ROOT, "devnet", "artifacts", `${CONTRACT}.json`);
const SETTINGS = {
  optimizer: { enabled: true, runs: 200 },
  // Pinned rather than solc's moving default, so the bytecode runs on any chain from Cancun on.
  evmVersion: "cancun",
  outputSelection: { [SOURCE]: { [CONTRACT]: ["abi", "evm.bytecode.object", "evm.deployedBytecode.object"] } },
};

const sha256 = (data) => createHash("sha256").update(data).digest("hex");

function packageVersion(name) {
  return JSON.parse(readFileSync(path.join(NODE_MODULES, name, "package.json"), "utf8")).version;
}

// Import callback: only `@openzeppelin/...` paths, resolved inside node_modules.
function findImports(importPath) {
  if (!importPath.startsWith("@openzeppelin/") || importPath.split("/").includes("..")) {
    return { error: `import not allowed: ${importPath}` };
  }
  const file = path.join(NODE_MODULES, importPath);
  if (!existsSync(file)) {
    return { error: `not found in node_modules (run \`npm ci\`): ${importPath}` };
  }
  return { contents: readFileSync(file, "utf8") };
}

function build() {
  const source = readFileSync(path.join(ROOT, SOURCE), "utf8");
  const input = { language: "Solidity", sources: { [SOURCE]: { content: source } }, settings: SETTINGS };
  const output = JSON.parse(solc.compile(JSON.stringify(input), { import: findImports }));

  const diagnostics = output.errors ?? [];
  for (const d of diagnostics) {
    process.stderr.write(`${d.formattedMessage ?? d.message}\n`);
  }
  if (diagnostics.some((d) => d.severity === "error")) {
    throw new Error("compilation failed");
  }

  const compiled = output.contracts[SOURCE][CONTRACT];
  const artifact = {
    contractName: CONTRACT,
    sourceName: SOURCE,
    compiler: {
      name: "solc",
      version: solc.version(),
      settings: { optimizer: SETTINGS.optimizer, evmVersion: SETTINGS.evmVersion },
    },
    openzeppelin: packageVersion("@openzeppelin/contracts"),
    source: { path: SOURCE, sha256: sha256(source) },
    abi: compiled.abi,
    bytecode: `0x${compiled.evm.bytecode.object}`,
    deployedBytecode: `0x${compiled.evm.deployedBytecode.object}`,
  };
  return `${JSON.stringify(artifact, null, 2)}\n`;
}

const text = build();
const relative = path.relative(ROOT, ARTIFACT);
if (process.argv.includes("--check")) {
  const current = existsSync(ARTIFACT) ? readFileSync(ARTIFACT, "utf8") : "";
  if (current !== text) {
    process.stderr.write(`${relative} is stale: run \`node devnet/build_contract.mjs\`\n`);
    process.exit(1);
  }
  process.stdout.write(`${relative} is up to date\n`);
} else {
  mkdirSync(path.dirname(ARTIFACT), { recursive: true });
  writeFileSync(ARTIFACT, text);
  process.stdout.write(`wrote ${relative} (sha256 ${sha256(text)})\n`);
}
