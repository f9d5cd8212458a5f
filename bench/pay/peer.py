"""The peer: the x402 reference facilitator (``@x402/evm`` exact scheme) timed by its own script on its own Anvil.

The peer lives outside this repository (``shared/bench/peer-x402``: README.md, run.mjs, a pinned
package-lock.json). ``run.mjs`` starts its own Anvil, settles ``N`` payments at concurrency 1 and then at each
of ``CONC``, checks the chain, and prints one JSON line; ``settle["c<CONC>"]`` holds the figures compared here
(``ok_per_s``, ``p50_ms``, ``p99_ms``, ``ok``, ``fail``). ``BLOCK_TIME=S`` makes its chain mine every S seconds
from the settle phases on (its concurrency-1 phase included: about N x S seconds before the concurrent one).

Nothing is downloaded here: when the peer's ``node_modules`` is missing, the run says how to install it and the
benchmark reports our figures alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.env import ROOT

PEER_SUBDIR = Path("shared") / "bench" / "peer-x402"
PEER_ENV = "PEER_X402_DIR"


def find_peer_dir(start: Path = ROOT) -> Path | None:
    """PEER_X402_DIR if set; else the first ``shared/bench/peer-x402`` (with a run.mjs) in ``start``'s
    parents (a checkout next to ``shared/``), then /work/shared/bench/peer-x402 (worktrees live in /work/wt)."""
    named = os.environ.get(PEER_ENV)
    if named:
        return Path(named).resolve()
    candidates = [parent / PEER_SUBDIR for parent in start.resolve().parents]
    candidates.append(Path("/work") / PEER_SUBDIR)
    return next((c for c in candidates if (c / "run.mjs").is_file()), None)


def missing(peer_dir: Path | None) -> str | None:
    """Why the peer cannot run (with how to install it), or None when it can."""
    if peer_dir is None:
        return f"peer not found: set {PEER_ENV} to the peer-x402 directory (with run.mjs) to compare with it"
    if not (peer_dir / "run.mjs").is_file():
        return f"peer not found: {peer_dir} has no run.mjs ({PEER_ENV})"
    if shutil.which("node") is None:
        return "peer not run: `node` (20+) is not on PATH"
    if not (peer_dir / "node_modules" / "@x402" / "evm").is_dir():
        return f"peer not installed: run `cd {peer_dir} && npm ci` once (the benchmark never downloads)"
    return None


@dataclass
class PeerResult:
    """One run of the peer at one concurrency: its figures, or why there are none (``note``)."""

    n: int
    conc: int
    block_time: int
    timeout: float
    note: str = ""  # not empty: no figures (not installed, did not finish, failed)
    rate: float = 0.0  # successful settlements per second of the concurrent phase (ok_per_s)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    ok: int = 0
    fail: int = 0
    chain_ok: bool = False  # run.mjs's own check: the merchant's balance and every nonce match what it reported
    seconds: float = 0.0  # the whole run.mjs, set-up and every phase
    versions: dict[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        return not self.note


def run_peer(peer_dir: Path | None, n: int, conc: int, block_time: int, timeout: float) -> PeerResult:
    """``node run.mjs`` with N=n, CONC=conc, NONCE_MANAGER=1 (the reference wiring fails most concurrent
    settles: README.md) and BLOCK_TIME=block_time (0: automine); killed after ``timeout`` seconds."""
    result = PeerResult(n, conc, block_time, timeout)
    why = missing(peer_dir)
    if why or peer_dir is None:
        result.note = why or "peer not found"
        return result
    env = {**os.environ, "N": str(n), "CONC": str(conc), "NONCE_MANAGER": "1"}
    env.pop("BLOCK_TIME", None)
    if block_time:
        env["BLOCK_TIME"] = str(block_time)
    started = time.monotonic()
    # Its own session: on a timeout the whole group goes (node and the Anvil it started).
    proc = subprocess.Popen(
        ["node", "run.mjs"], cwd=peer_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
        result.seconds = time.monotonic() - started
        result.note = f"did not finish in {timeout:.0f} s"
        return result
    result.seconds = time.monotonic() - started
    return parse(result, out, err, proc.returncode)


def parse(result: PeerResult, out: str, err: str, returncode: int) -> PeerResult:
    """Fill ``result`` from run.mjs's JSON line (exit 0: its on-chain check matched; 1: it did not)."""
    line = next((x for x in reversed(out.splitlines()) if x.startswith("{")), None)
    if line is None:
        result.note = f"failed (exit {returncode}): {(err or out).strip()[-300:]}"
        return result
    doc = json.loads(line)
    phase = doc.get("settle", {}).get(f"c{result.conc}")
    if not phase:
        result.note = f"no settle phase c{result.conc} in its output"
        return result
    result.rate = float(phase["ok_per_s"])
    result.p50_ms, result.p99_ms = float(phase["p50_ms"]), float(phase["p99_ms"])
    result.ok, result.fail = int(phase["ok"]), int(phase["fail"])
    result.chain_ok = bool(doc.get("ok"))
    result.versions = dict(doc.get("versions") or {})
    return result


def describe(results: list[PeerResult]) -> str:
    """One line on what the peer is and which versions ran."""
    versions = next((r.versions for r in results if r.versions), {})
    named = ", ".join(f"{k} {v}" for k, v in versions.items())
    return (
        "peer: the x402 reference facilitator (`@x402/evm` ExactEvmScheme via `@x402/core` x402Facilitator, "
        "in-process, no HTTP) settling EIP-3009 transfers on its own Anvil, relay account with viem's "
        "nonceManager (NONCE_MANAGER=1), one relay account" + (f"; {named}" if named else "")
    )
