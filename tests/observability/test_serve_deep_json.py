"""A deeply nested JSON body against a real `payintent serve` (gunicorn): refused, and the worker lives.

py_ecc (imported by eth-account) raises the recursion limit to 100,000; a ~40 KB body nested 20,000
levels deep then overflowed the C stack of the gunicorn worker that parsed it (SIGSEGV) on any route
that reads a JSON body, the public checkout API included, before any rate limit counted it.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import psutil
import requests

from tests.observability.test_serve import PAYINTENT, start_serve

DEEP = 20_000
DEEP_BODY = b"[" * DEEP + b"]" * DEEP  # 40 KB: under the 64 KB body limit
JSON = {"Content-Type": "application/json"}


def workers_of(master: subprocess.Popen[bytes]) -> set[int]:
    return {child.pid for child in psutil.Process(master.pid).children()}


def create_merchant(env: dict[str, str]) -> str:
    done = subprocess.run(
        [PAYINTENT, "merchant", "create", "--email", "deep@example.com", "--password", "correct horse battery"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["api_key"])


def test_a_deeply_nested_body_is_refused_and_the_worker_lives(tmp_path, stub_rpc):
    proc, base = start_serve(tmp_path, stub_rpc, workers=1)
    try:
        env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'serve.db'}",
               "PAYINTENT_VAR_DIR": str(tmp_path / "var")}  # fmt: skip
        api_key = create_merchant(env)
        workers = workers_of(proc)
        assert len(workers) == 1
        attacks = [
            (f"{base}/api/v1/checkout/intents/{uuid.uuid4()}/pay", JSON),  # public: no key needed
            (f"{base}/api/v1/x402/pay", {**JSON, "Authorization": f"Bearer {api_key}"}),  # keyed
            (f"{base}/api/v1/x402/intents", {**JSON, "Authorization": f"Bearer {api_key}"}),
        ]
        for url, headers in attacks:
            answer = requests.post(url, data=DEEP_BODY, headers=headers, timeout=30)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["code"] == "INVALID_JSON" and "deeper than 32 levels" in error["message"], error
            # The same worker answers the next request: it did not die and was not replaced.
            assert requests.get(f"{base}/healthz", timeout=10).status_code == 200
            assert workers_of(proc) == workers
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
