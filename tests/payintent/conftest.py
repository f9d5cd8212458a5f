"""The client against a real API over HTTP, on the real devnet with a real relayer process.

The settlement fixtures are reused by import. Imported into this folder they are registered
again, so a session running tests/settlement too starts a second devnet and relayer for this
folder; ``redis_server_url`` is overridden here so that this folder's relayer and API use their
own Redis, and the two relayers never take each other's jobs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
from werkzeug.serving import WSGIRequestHandler, make_server

from tests.settlement.conftest import devnet, pay_app, relayer, shop  # noqa: F401


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of this folder's own: a private redis-server, or another database of the external one."""
    import os

    external = os.environ.get("PAYINTENT_TEST_REDIS_URL")
    if external:
        yield _other_database(external)
        return
    from backend.devstack import start_private_redis

    proc, url = start_private_redis(tmp_path_factory.mktemp("client-redis"))
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _other_database(url: str) -> str:
    """The same Redis server, the database before the URL's (CI uses /15: this folder gets /14)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = dict(parse_qsl(parts.query))
        query["db"] = str((int(query.get("db", 0)) + 15) % 16)
        return urlunsplit(parts._replace(query=urlencode(query)))
    db = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(db + 15) % 16}"))


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
