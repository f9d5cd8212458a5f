"""Container health checks for ``docker-compose.yml``: exit 0 when healthy, 1 when not (one line on stderr).

    python /app/deploy/healthcheck.py http http://127.0.0.1:8000/healthz   # the api answers 200
    python /app/deploy/healthcheck.py worker    # an RQ worker of this container listens on the worker queue
    python /app/deploy/healthcheck.py relayer   # a relayer of this container takes a RELAYER_QUEUE:<network>'s

A worker or relayer counts as healthy once it has registered with Redis (what the tests wait for
before they send it work): that proves it started, loaded its configuration (the relayer: its
keys) and reaches Redis. RQ drops a worker's registration when the process stops sending heartbeats;
a relayer's presence key expires when it stops refreshing it.
Containers are told apart by host name (each container has its own). Health checks do not run
through the image's entrypoint, so ``*_FILE`` secrets are read here too.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from entrypoint import ConfigError, load_secret_files

WORKER_QUEUE = "payintent"  # backend.queueing.DEFAULT_QUEUE (the worker also listens on the webhook queue)
RELAYER_QUEUE_DEFAULT = "relayer"  # backend.config.Settings.relayer_queue
RELAYER_ALIVE_KEY = "payintent:relayer:alive:{host}:{pid}"  # backend.settlement.intake.ALIVE_KEY


def check_http(url: str, timeout: float = 3.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        return f"{url}: {exc}"
    return None if status == 200 else f"{url}: HTTP {status}"


def _with_redis(probe: Callable[[Any, str], str | None], hostname: str | None) -> str | None:
    """``probe(connection, hostname)`` on REDIS_URL's Redis (3 s timeouts), its problem or None; a Redis error
    is the problem."""
    from redis import Redis, RedisError

    url = os.environ.get("REDIS_URL", "").strip()
    if not url:
        return "REDIS_URL is not set"
    connection = Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)
    try:
        return probe(connection, hostname or socket.gethostname())
    except RedisError as exc:
        return f"redis: {exc}"
    finally:
        connection.close()


def check_rq(queue_name: str, hostname: str | None = None) -> str | None:
    """None when an RQ worker of this host listens on ``queue_name``."""

    def probe(connection: Any, host: str) -> str | None:
        from rq import Worker

        if any(w.hostname == host and queue_name in w.queue_names() for w in Worker.all(connection=connection)):
            return None
        return f"no worker of {host} listens on queue {queue_name!r}"

    return _with_redis(probe, hostname)


def check_relayer(queue_name: str, hostname: str | None = None) -> str | None:
    """None when a relayer of this host is present (its RELAYER_ALIVE_KEY, refreshed while it runs) and takes
    settlements of a ``<queue_name>:<network>`` (backend.queueing.relayer_queue names them so)."""

    def probe(connection: Any, host: str) -> str | None:
        for key in connection.scan_iter(match=RELAYER_ALIVE_KEY.format(host=host, pid="*"), count=1000):
            value = connection.get(key)
            try:
                queues = json.loads(value)["queues"] if value is not None else []
            except (ValueError, TypeError, KeyError):
                continue
            if any(str(q).startswith(f"{queue_name}:") for q in queues):
                return None
        return f"no relayer of {host} takes settlements of {queue_name + ':<network>'!r}"

    return _with_redis(probe, hostname)


def main(argv: list[str]) -> int:
    try:
        os.environ.update(load_secret_files(os.environ))
    except ConfigError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    if len(argv) == 2 and argv[0] == "http":
        problem = check_http(argv[1])
    elif argv == ["worker"]:
        problem = check_rq(WORKER_QUEUE)
    elif argv == ["relayer"]:
        problem = check_relayer(os.environ.get("RELAYER_QUEUE", "").strip() or RELAYER_QUEUE_DEFAULT)
    else:
        print("usage: healthcheck.py http URL | worker | relayer", file=sys.stderr)
        return 2
    if problem:
        print(f"healthcheck: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
