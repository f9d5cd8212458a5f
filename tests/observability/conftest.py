"""Fixtures for logs, /metrics and /readyz: a stub JSON-RPC chain, a scrape parser, the devnet.

The settlement fixtures are reused by import (``devnet``, ``shop``, ``pay_client``); ``relayer`` and
``pay_app`` are this folder's own: the relayer takes jobs from a queue of its own (a session also
running tests/settlement has another relayer, of another devnet, on the same Redis) and writes its
JSON log to a file the tests read.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.settlement.conftest import devnet, make_pay_app, pay_client, shop, start_relayer, stop_process  # noqa: F401
from tests.webhooks.conftest import receiver  # noqa: F401

METRICS_TOKEN = "metrics-test-token-123"
RELAYER_QUEUE = "relayer-observability"
BASE_SEPOLIA = "eip155:84532"
SOLANA = "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"


# --- scraping ------------------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: Any) -> Samples:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 200, response.data
    assert response.content_type.startswith("text/plain; version=")
    return parse(response.get_data(as_text=True))


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def with_metrics_token(app: Any) -> Any:
    app.config["PAYINTENT_SETTINGS"] = replace(app.config["PAYINTENT_SETTINGS"], metrics_token=METRICS_TOKEN)
    return app


# --- a stub chain --------------------------------------------------------------------------------


@dataclass
class StubRpc:
    """A JSON-RPC server answering as an EVM chain (eth_chainId, eth_getBalance) or Solana (getHealth, getBalance)."""

    server: ThreadingHTTPServer
    chain_id: int = 84532
    balances: dict[str, int] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v2/stub-provider-key-0123456789"

    def answer(self, method: str, params: list[Any]) -> Any:
        self.calls.append(method)
        if method == "eth_chainId":
            return hex(self.chain_id)
        if method == "eth_getBalance":
            return hex(self.balances.get(params[0].lower(), 0))
        if method == "getHealth":
            return "ok"
        if method == "getBalance":
            return {"context": {"slot": 1}, "value": self.balances.get(params[0], 0)}
        raise KeyError(method)


@pytest.fixture
def stub_rpc() -> Iterator[StubRpc]:
    stub: StubRpc

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = json.dumps(
                {"jsonrpc": "2.0", "id": body["id"], "result": stub.answer(body["method"], body["params"])}
            )
            data = answer.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    stub = StubRpc(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    thread = threading.Thread(target=stub.server.serve_forever, daemon=True)
    thread.start()
    yield stub
    stub.server.shutdown()
    stub.server.server_close()


def chains_file(path: Path, networks: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"networks": networks}))
    return path


def evm_network(rpc_url: str, network: str = BASE_SEPOLIA, **extra: Any) -> dict[str, Any]:
    return {"network": network, "rpc_url": rpc_url, "usdc_address": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
            "usdc_domain_name": "USDC", **extra}  # fmt: skip


# --- the devnet, a relayer of this folder's own --------------------------------------------------


@pytest.fixture(scope="session")
def relayer(db_url: str, redis_server_url: str, devnet: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    log = tmp_path_factory.mktemp("observability-relayer") / "relayer.log"
    proc = start_relayer(db_url, redis_server_url, devnet.info["chains_file"], log_file=log,
                         RELAYER_QUEUE=RELAYER_QUEUE, LOG_LEVEL="INFO", LOG_FORMAT="json")  # fmt: skip
    proc.log_path = log  # type: ignore[attr-defined]
    yield proc
    stop_process(proc)


@pytest.fixture
def pay_app(db_url: str, redis_server_url: str, devnet: Any, relayer: Any) -> Iterator[Any]:  # noqa: F811
    from backend.extensions import db

    application = make_pay_app(db_url, redis_server_url, devnet, relayer_queue=RELAYER_QUEUE,
                               metrics_token=METRICS_TOKEN, log_level="INFO")  # fmt: skip
    with application.app_context():
        yield application
        db.session.remove()
        db.engine.dispose()
