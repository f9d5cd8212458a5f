// Copies the Swagger UI files the API docs page (/api/v1/docs) needs, from the npm package swagger-ui-dist
// (pinned in package.json, locked in package-lock.json), into backend/static/apidocs/swagger-ui/, which the app
// serves itself: the page loads nothing from a CDN. `make install` runs it after `npm ci`; the Dockerfile runs
// it with --pack, where there is no node_modules.
//
//   node deploy/swagger_ui.mjs [--pack] [DEST]
//
// Without --pack the files come from node_modules/swagger-ui-dist, which must be the locked version. With
// --pack the locked version's tarball is fetched with `npm pack` (nothing is installed, no script runs) and
// checked against the lock's integrity hash before anything is copied.

import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, renameSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..");
// What backend/templates/apidocs/docs.html loads, and the licence that comes with it.
const FILES = ["swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png", "LICENSE", "NOTICE"];

let work = null; // --pack's temporary directory

function fail(message) {
  console.error(`deploy/swagger_ui.mjs: ${message}`);
  if (work) rmSync(work, { recursive: true, force: true });
  process.exit(1);
}

const args = process.argv.slice(2);
const pack = args.includes("--pack");
const dest = resolve(args.find((a) => !a.startsWith("--")) ?? join(ROOT, "backend/static/apidocs/swagger-ui"));
const locked = JSON.parse(readFileSync(join(ROOT, "package-lock.json"), "utf8")).packages?.[
  "node_modules/swagger-ui-dist"
];
if (!locked?.version || !locked?.integrity) fail("swagger-ui-dist is not in package-lock.json");

let source;
if (pack) {
  work = mkdtempSync(join(tmpdir(), "swagger-ui-"));
  const packed = JSON.parse(
    execFileSync("npm", ["pack", "--json", "--ignore-scripts", `swagger-ui-dist@${locked.version}`], {
      cwd: work,
      encoding: "utf8",
    }),
  );
  const tarball = join(work, packed[0].filename);
  const separator = locked.integrity.indexOf("-");
  const [algorithm, expected] = [locked.integrity.slice(0, separator), locked.integrity.slice(separator + 1)];
  const actual = createHash(algorithm).update(readFileSync(tarball)).digest("base64");
  if (actual !== expected) fail(`${packed[0].filename} does not match package-lock.json's ${algorithm} hash`);
  execFileSync("tar", ["-xzf", tarball, "-C", work]);
  source = join(work, "package");
} else {
  source = join(ROOT, "node_modules/swagger-ui-dist");
  let installed;
  try {
    installed = JSON.parse(readFileSync(join(source, "package.json"), "utf8")).version;
  } catch {
    fail("node_modules/swagger-ui-dist is missing: run npm ci (make install does)");
  }
  if (installed !== locked.version) fail(`node_modules has swagger-ui-dist ${installed}, the lock ${locked.version}: run npm ci`);
}

// Copied beside the destination, then renamed into place: never a half-copied directory.
const staging = `${dest}.partial`;
rmSync(staging, { recursive: true, force: true });
mkdirSync(staging, { recursive: true });
for (const file of FILES) copyFileSync(join(source, file), join(staging, file));
rmSync(dest, { recursive: true, force: true });
renameSync(staging, dest);
if (work) rmSync(work, { recursive: true, force: true });
console.log(`Swagger UI ${locked.version} -> ${dest}`);
