"""`payintent serve` (gunicorn, several workers): /metrics sums every worker, every log line is JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from backend.migrate import upgrade
from harness.ready import wait_healthy as _wait_healthy
from tests.conftest import free_port
from tests.observability.conftest import METRICS_TOKEN, Samples, chains_file, evm_network, parse, value

PAYINTENT = str(Path(sys.executable).with_name("payintent"))
HEALTHZ = {"method": "GET", "route": "/healthz", "status": "200"}


def scrape(base: str) -> Samples:
    scraped = requests.get(f"{base}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10)
    assert scraped.status_code == 200
    return parse(scraped.text)


def get(url: str, request_id: str) -> requests.Response:
    return requests.get(url, headers={"X-Request-Id": request_id}, timeout=10)


def start_serve(tmp_path: Path, stub_rpc: Any, workers: int = 3, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    """`payintent serve` on a free port with a migrated SQLite database, logging JSON to tmp_path/serve.log."""
    database_url = f"sqlite:///{tmp_path / 'serve.db'}"
    upgrade(database_url)
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url, "METRICS_TOKEN": METRICS_TOKEN,
           "CHAINS_FILE": str(chains_file(tmp_path / "chains.json", [evm_network(stub_rpc.url)])),
           "LOG_LEVEL": "INFO", "LOG_FORMAT": "json", "PAYINTENT_VAR_DIR": str(tmp_path / "var"),
           "SECRET_KEY": "serve-test-secret-key", **env}  # fmt: skip
    with (tmp_path / "serve.log").open("wb") as out:
        proc = subprocess.Popen([PAYINTENT, "serve", "--port", str(port), "--workers", str(workers)], env=env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, [proc])
    except BaseException:
        proc.kill()
        raise
    return proc, base


def _settled(base: str) -> float | None:
    """The /healthz count once it stopped moving for 1 s: a start-up probe the client gave up on (1 s timeout, a
    worker still booting on a loaded machine) is answered and counted later, and must not land in the test's
    count (it once made 41 of 40)."""
    deadline = time.monotonic() + 20
    now = value(scrape(base), "payintent_http_request_duration_seconds_count", **HEALTHZ)
    while True:
        time.sleep(1.0)
        then, now = now, value(scrape(base), "payintent_http_request_duration_seconds_count", **HEALTHZ)
        if now == then or time.monotonic() > deadline:
            return now


def test_metrics_sum_all_gunicorn_workers_and_logs_are_json(tmp_path, redis_url, stub_rpc):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "histogram_1.db").write_bytes(b"left by an earlier run")  # must be removed, not summed
    log = tmp_path / "serve.log"
    proc, base = start_serve(tmp_path, stub_rpc, REDIS_URL=redis_url, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    try:
        before = _settled(base)
        sent = 0
        deadline = time.monotonic() + 30
        while True:  # batches until two workers have answered: on a busy machine the others boot late
            with ThreadPoolExecutor(8) as pool:  # concurrent: busy workers leave the next connections to the others
                answers = list(pool.map(lambda n: get(f"{base}/healthz", f"probe-{n}"), range(40)))
            assert [a.headers["X-Request-Id"] for a in answers] == [f"probe-{n}" for n in range(40)]
            sent += 40
            served_by = {p.name for p in metrics_dir.glob("histogram_*.db")} - {"histogram_1.db"}
            if len(served_by) >= 2 or time.monotonic() > deadline:
                break
        assert len(served_by) >= 2 and not (metrics_dir / "histogram_1.db").exists()  # several workers answered
        assert get(f"{base}/readyz", "ready-1").status_code == 200
        assert get(f"{base}/api/v1/x402/intents", "no-key-1").status_code == 401
        samples = scrape(base)
        # Every answer counted, whichever of the three workers gave it.
        assert value(samples, "payintent_http_request_duration_seconds_count", **HEALTHZ) - before == sent
        assert value(samples, "payintent_metrics_source_up", source="redis") == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    logged = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]  # every line is JSON
    assert {"gunicorn.error", "payintent.request"} <= {line["logger"] for line in logged}
    (refused,) = [line for line in logged if line.get("request_id") == "no-key-1"]
    assert (refused["route"], refused["status"], refused["method"]) == ("/api/v1/x402/intents", 401, "GET")
    assert "stub-provider-key" not in log.read_text()
    assert metrics_dir.exists()  # a directory the operator named is kept (one serve made for itself is removed)


def test_a_private_metrics_directory_is_removed_on_exit_and_a_killed_servers_on_the_next_start(tmp_path, stub_rpc):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: a master killed before it could clean up
    stale = tmp / f"payintent-metrics-{gone.pid}-x1y2"
    stale.mkdir()
    (stale / "histogram_123.db").write_bytes(b"1")
    kept = tmp / "payintent-metrics-unrelated"
    kept.mkdir()
    proc, base = start_serve(tmp_path, stub_rpc, workers=1, TMPDIR=str(tmp))
    own: list[Path] = []
    try:
        assert get(f"{base}/healthz", "h-1").status_code == 200
        own = list(tmp.glob(f"payintent-metrics-{proc.pid}-*"))  # serve execs gunicorn: the same pid
        assert len(own) == 1 and list(own[0].glob("histogram_*.db"))
        assert not stale.exists() and kept.exists()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert own and not own[0].exists()
