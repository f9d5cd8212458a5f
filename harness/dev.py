"""``payintent dev`` as a child process (the e2e fixtures): started on a free port with its own var dir and
devnet ports, ready once it prints its banner, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from harness.env import PAYINTENT
from harness.errors import HarnessError
from harness.ports import HOST, free_port, free_port_base

if TYPE_CHECKING:
    import requests

READY_LINE = "Ctrl-C stops everything"
# CHAINS_FILE unset: the devnet starts; the others: its own SQLite, Redis and checkout host.
UNSET = ("DATABASE_URL", "REDIS_URL", "CHECKOUT_HOST", "CHAINS_FILE")


@dataclass
class DevStack:
    """A running ``payintent dev``: its URL, its demo data and a client for its API."""

    base_url: str
    demo: dict[str, Any] = field(repr=False)
    var_dir: Path
    process: subprocess.Popen[str] = field(repr=False)
    output: list[str] = field(default_factory=list, repr=False)

    @property
    def api_key(self) -> str:
        """The demo merchant's API key (it has a wallet on every network)."""
        return str(self.demo["api_key"])

    def url(self, path: str) -> str:
        """An absolute URL for a path on the stack, e.g. ``url("/dashboard/login")``."""
        return f"{self.base_url}{path}"

    def api(self, method: str, path: str, *, key: str | None = None, **kwargs: Any) -> requests.Response:
        """Call ``/api/v1<path>`` with ``key`` (default: the demo key) as the Bearer token.

        ``key=""`` sends no Authorization header. Other arguments go to ``requests.request``.
        """
        import requests

        key = self.api_key if key is None else key
        headers = dict(kwargs.pop("headers", None) or {})
        if key:
            headers["Authorization"] = f"Bearer {key}"
        kwargs.setdefault("timeout", 15)
        return requests.request(method, f"{self.base_url}/api/v1{path}", headers=headers, **kwargs)

    def create_intent(self, amount_usdc: float = 1.0, *, key: str | None = None, **fields: Any) -> dict[str, Any]:
        """POST /x402/intents and return its ``data`` (asserts 201)."""
        response = self.api("POST", "/x402/intents", key=key, json={"amount_usdc": amount_usdc, **fields})
        assert response.status_code == 201, response.text
        return response.json()["data"]  # type: ignore[no-any-return]  # the API's JSON envelope

    def log(self) -> str:
        """Everything the stack printed to stdout so far."""
        return "".join(self.output)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (``payintent dev`` stops everything it started), SIGKILL after ``timeout`` s."""
        stop_dev(self.process, timeout)


def dev_env(var_dir: Path) -> dict[str, str]:
    """This process's environment for a ``payintent dev`` of its own: var dir ``var_dir``, the devnet on free
    ports, its own database, Redis and chains."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["PAYINTENT_VAR_DIR"] = str(var_dir)
    env["PAYINTENT_DEVNET_PORT_BASE"] = str(free_port_base())
    return env


def stop_dev(process: subprocess.Popen[str], timeout: float = 30) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _drain(stream: IO[str], sink: list[str], ready: threading.Event) -> None:
    for line in stream:
        sink.append(line)
        if READY_LINE in line:
            ready.set()
    ready.set()  # EOF: the process is gone; the waiter checks why


def start_dev(workdir: Path, port: int | None = None, timeout: float = 120) -> DevStack:
    """``payintent dev`` on ``port`` (default: a free one) with the var dir ``workdir``/var, its stderr in
    ``workdir``/stderr.log; returns once it printed its banner. HarnessError (with its output) when it did not
    start; it is stopped then."""
    var_dir = workdir / "var"
    port = port or free_port()
    stderr_path = workdir / "stderr.log"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [PAYINTENT, "dev", "--port", str(port)], env=dev_env(var_dir), stdout=subprocess.PIPE, stderr=stderr,
            text=True,
        )  # fmt: skip
    output: list[str] = []
    ready = threading.Event()
    assert process.stdout is not None
    threading.Thread(target=_drain, args=(process.stdout, output, ready), daemon=True).start()
    try:
        if not ready.wait(timeout) or READY_LINE not in "".join(output):
            tail = stderr_path.read_text()[-4000:]
            raise HarnessError(f"payintent dev did not start (exit {process.poll()}):\n{''.join(output)}\n{tail}")
        demo = json.loads((var_dir / "demo.json").read_text())
    except BaseException:
        stop_dev(process)
        raise
    return DevStack(f"http://{HOST}:{port}", demo, var_dir, process, output)
