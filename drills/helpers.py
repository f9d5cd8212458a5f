"""The drills' helper processes, each started as ``python -m drills.helpers <kind> ...`` (from the checkout's
root; the chain RPC's forwarder is the harness's, ``python -m harness.proxy forward``):

- ``receiver``: a merchant's webhook endpoint that answers 200 and appends every body it gets to a
  JSON-lines file (which outlives the process, so a receiver can go down and come back);
- ``worker``: ``payintent worker`` itself, with the service clock moved forward by the number of
  seconds in a file, so that a webhook retry schedule of hours passes in seconds.

``receiver`` prints ``ready <port>`` once it listens (harness.servers.run_server).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from harness.servers import Handler, run_server


def receiver(log: Path) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode("latin-1").split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length)
                with log.open("a") as out:  # before answering: an event answered 200 is on disk
                    out.write(body.decode("utf-8", "replace").replace("\n", " ") + "\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")
                await writer.drain()
        writer.close()

    return handle


def received(log: Path) -> list[dict[str, object]]:
    """The bodies a receiver recorded, in order (a body cut short by a kill is skipped)."""
    if not log.exists():
        return []
    bodies = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            bodies.append(json.loads(line))
    return bodies


def clock_offset(path: Path) -> float:
    """Seconds the drill has moved the worker's clock forward (0 until it writes the file)."""
    with contextlib.suppress(OSError, ValueError):
        return float(path.read_text().strip() or 0)
    return 0.0


def run_worker(offset_file: Path) -> None:
    from backend import clock
    from backend.cli import main

    clock.set_clock(lambda: datetime.now(UTC) + timedelta(seconds=clock_offset(offset_file)))
    main(["worker"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=("receiver", "worker"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--file", type=Path)
    args = parser.parse_args(argv)
    if args.kind == "receiver":
        return run_server(receiver(args.file), args.port)
    run_worker(args.file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
