"""Helper servers: a small asyncio server in a child process that prints ``ready <port>`` once it listens
(the RPC forwarder and recording proxy of ``harness.proxy``, the benchmarks' and drills' webhook receivers)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from harness.env import ROOT
from harness.errors import HarnessError
from harness.ports import HOST
from harness.processes import ProcessSet

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run_server(handle: Handler, port: int = 0, backlog: int = 100) -> int:
    """The main of a helper process: an asyncio server on HOST:port (0: any free port) that prints
    `ready <port>` once it listens, and serves until SIGTERM or Ctrl-C."""

    async def serve() -> None:
        server = await asyncio.start_server(handle, HOST, port, backlog=backlog)
        print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


def start_helper(
    procs: ProcessSet, script: str, args: list[str], log: Path, what: str
) -> tuple[subprocess.Popen[str], int]:
    """Start a helper server (see run_server), its stderr to `log`; returns the process and its port once it
    is ready. `script` is a file (``bench/webhooks.py``: the script again) or a module (``harness.proxy``)."""
    target = [str(Path(script).resolve())] if script.endswith(".py") else ["-m", script]
    with log.open("w") as out:
        proc: subprocess.Popen[str] = procs.start(
            [sys.executable, *target, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=out, text=True
        )
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    if len(words) != 2 or words[0] != "ready":
        raise HarnessError(f"the {what} did not start: {log.read_text()[-2000:]}")
    return proc, int(words[1])
