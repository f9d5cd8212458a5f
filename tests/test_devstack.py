"""`payintent dev` (make run): the stack comes up on embedded defaults, serves the demo key, stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

from devnet import free_port_base
from tests.conftest import free_port

PAYINTENT = str(Path(sys.executable).with_name("payintent"))


def test_dev_stack_serves_the_seeded_demo_merchant(tmp_path):
    port = free_port()
    unset = ("DATABASE_URL", "REDIS_URL", "CHECKOUT_HOST", "CHAINS_FILE")  # CHAINS_FILE unset: the devnet starts
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PAYINTENT_VAR_DIR"] = str(tmp_path / "var")
    env["PAYINTENT_DEVNET_PORT_BASE"] = str(free_port_base())
    proc = subprocess.Popen(
        [PAYINTENT, "dev", "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        banner = ""
        deadline = time.monotonic() + 90
        while "Ctrl-C stops everything" not in banner:
            assert proc.poll() is None and time.monotonic() < deadline, banner
            banner += proc.stdout.readline()
        demo = json.loads((tmp_path / "var" / "demo.json").read_text())
        assert demo["api_key"] in banner and "curl" in banner
        assert (tmp_path / "var" / "payintent.db").exists()  # SQLite under var/ by default
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis-server" in " ".join(c.cmdline()) for c in children)  # a private, real Redis
        assert sum("anvil" in " ".join(c.cmdline()) for c in children) == 3  # the local devnet
        chains = json.loads(Path(demo["chains_file"]).read_text())["networks"]
        assert [b["address"] in banner and b["private_key"] in banner for b in demo["buyers"]] == [True] * 3
        response = requests.post(
            f"http://127.0.0.1:{port}/api/v1/x402/intents",
            json={"amount_usdc": 10.5},
            headers={"Authorization": f"Bearer {demo['api_key']}"},
            timeout=10,
        )
        assert response.status_code == 201
        requirements = response.json()["data"]["payment_requirements"]
        assert len(requirements) == len(chains) == 3
        assert {r["asset"] for r in requirements} == {c["usdc_address"] for c in chains}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
