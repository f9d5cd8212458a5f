"""The client against a real API over HTTP, on the real devnet with a real relayer process.

The settlement fixtures are reused by import. Imported into this folder they are registered
again, so a session running tests/settlement too starts a second devnet and relayer for this
folder; ``redis_server_url`` is overridden here so that this folder's relayer and API use their
own Redis (the external one: the worker's second database), and the two relayers never take each
other's jobs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.serving import WSGIRequestHandler, make_server

from tests.conftest import private_redis, worker_redis_url
from tests.settlement.conftest import devnet, pay_app, relayer, shop  # noqa: F401


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of this folder's own: a private redis-server, or another database of the external one."""
    import os

    external = os.environ.get("PAYINTENT_TEST_REDIS_URL")
    if external:
        yield worker_redis_url(external, shift=1)
        return
    yield from private_redis(tmp_path_factory.mktemp("client-redis"))


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


def serve(app: Any) -> Iterator[str]:
    """Serve a WSGI app over real HTTP (werkzeug, threaded) on a free port; yields its base URL."""
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="served-under-test", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


@pytest.fixture
def api_url(pay_app: Any) -> Iterator[str]:  # noqa: F811
    """The settlement test app served over real HTTP."""
    yield from serve(pay_app)
