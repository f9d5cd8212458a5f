"""How bench/api measures: wrk (one Lua script per cell), the CPU of each process group, and a cell's numbers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import BenchError, CpuGroups, ProcessSet, process_tree
from bench.api.stack import INTENTS

WRK_INSTALL = "apt-get update && apt-get install -y wrk   (Debian/Ubuntu; macOS: brew install wrk)"

# One Lua script per cell. `done` prints one JSON line that run_wrk parses. wrk counts a response
# with status > 399 as a "status" error; every cell is also checked for its exact status first.
WRK_LUA = r"""
local mode = "__MODE__"
local ids = {__IDS__}
local counter = 0
local next_thread = 0
tid = 0

wrk.headers["Authorization"] = "Bearer __TOKEN__"
if mode == "create" then
  wrk.headers["Content-Type"] = "application/json"
end

function setup(thread)
  next_thread = next_thread + 1
  thread:set("tid", next_thread)
end

function request()
  counter = counter + 1
  if mode == "get" then
    return wrk.format("GET", "__INTENTS__/" .. ids[counter % #ids + 1])
  elseif mode == "list" then
    return wrk.format("GET", "__INTENTS__?limit=20")
  elseif mode == "create" then
    local body = string.format('{"amount_usdc": 10.5, "order_id": "bench-%d-%d"}', tid, counter)
    return wrk.format("POST", "__INTENTS__", nil, body)
  end
  return wrk.format("GET", "/bare")
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_RESULT {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,' ..
    '"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
"""


@dataclass
class LoadSettings:
    threads: int
    connections: int
    duration: int
    warmup: int
    timeout: int = 10


@dataclass
class Cell:
    server: str  # "bare", "sqlite", "postgresql"
    endpoint: str  # "bare", "get", "list", "create"
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: dict[str, int]
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU ms per request: app, db, wrk
    other_share: float = 0.0  # busy share of the machine's cores used by processes that are not ours
    attempts: int = 1
    note: str = ""

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


# --- wrk -----------------------------------------------------------------------------------------


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        sys.exit(f"bench/api.py needs the wrk load generator, which is not on PATH. Install it with:\n  {WRK_INSTALL}")
    return path


def wrk_version() -> str:
    out = subprocess.run([wrk_path(), "-v"], capture_output=True, text=True, check=False)
    match = re.search(r"wrk (\S+)", out.stdout + out.stderr)
    return match.group(1) if match else "unknown"


def write_lua(workdir: Path, mode: str, token: str = "", ids: list[str] | None = None) -> Path:
    script = (
        WRK_LUA.replace("__MODE__", mode)
        .replace("__TOKEN__", token)
        .replace("__INTENTS__", INTENTS)
        .replace("__IDS__", ", ".join(f'"{i}"' for i in (ids or ["none"])))
    )
    path = workdir / f"wrk-{mode}.lua"
    path.write_text(script)
    return path


def run_wrk(url: str, script: Path, seconds: int, load: LoadSettings, procs: ProcessSet) -> dict[str, Any]:
    argv = [
        wrk_path(),
        f"--threads={load.threads}",
        f"--connections={load.connections}",
        f"--duration={seconds}s",
        f"--timeout={load.timeout}s",
        f"--script={script}",
        url,
    ]
    proc = procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=seconds + 60)
    finally:
        procs.stop(proc)
    for line in out.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line.removeprefix("BENCH_RESULT "))  # type: ignore[no-any-return]
    raise BenchError(f"wrk printed no result (exit {proc.returncode}):\n{out}")


# --- CPU -----------------------------------------------------------------------------------------


class CpuMeter(CpuGroups):
    """CPU seconds spent during a cell, split into the app server, PostgreSQL, wrk and everything else.

    The machine may be shared: "other" is the busy time of processes that are not ours, so that a cell
    measured while something else ran can be seen (and re-run).
    """

    def __init__(self, server_pid: int, db_pids: Callable[[], set[int]]) -> None:
        super().__init__({"app": lambda: process_tree(server_pid), "db": db_pids}, "self")

    def _snapshot(self) -> dict[str, float]:
        snap = super()._snapshot()
        me = os.times()
        snap["wrk"] = me.children_user + me.children_system  # wrk is reaped before the second snapshot
        return snap


def cell_of(server: str, endpoint: str, result: dict[str, Any], used: dict[str, float]) -> Cell:
    """A cell from wrk's result and the CPU used meanwhile (``CpuMeter.stop``)."""
    seconds = result["duration_us"] / 1e6
    requests = max(1, int(result["requests"]))
    return Cell(
        server=server,
        endpoint=endpoint,
        rps=requests / seconds,
        p50_ms=result["p50_us"] / 1000,
        p99_ms=result["p99_us"] / 1000,
        requests=requests,
        errors={k: int(result[k]) for k in ("connect", "read", "write", "status", "timeout") if result[k]},
        cpu_ms={k: 1000 * used[k] / requests for k in ("app", "db", "wrk")},
        other_share=used["other"] / (seconds * (os.cpu_count() or 1)),
    )
