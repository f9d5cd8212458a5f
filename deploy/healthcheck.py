"""Container health checks for ``docker-compose.yml``: exit 0 when healthy, 1 when not (one line on stderr).

    python /app/deploy/healthcheck.py http http://127.0.0.1:8000/healthz   # the api answers 200
    python /app/deploy/healthcheck.py worker    # an RQ worker of this container listens on the worker queue
    python /app/deploy/healthcheck.py relayer   # an RQ worker of this container listens on a RELAYER_QUEUE:<network>

A worker or relayer counts as healthy once it has registered with Redis (what the tests wait for
before they send it work): that proves it started, loaded its configuration (the relayer: its
keys) and reaches Redis. RQ drops the registration when the process stops sending heartbeats.
Containers are told apart by host name (each container has its own). Health checks do not run
through the image's entrypoint, so ``*_FILE`` secrets are read here too.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request

from entrypoint import ConfigError, load_secret_files

WORKER_QUEUE = "payintent"  # backend.queueing.DEFAULT_QUEUE (the worker also listens on the webhook queue)
RELAYER_QUEUE_DEFAULT = "relayer"  # backend.config.Settings.relayer_queue


def check_http(url: str, timeout: float = 3.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        return f"{url}: {exc}"
    return None if status == 200 else f"{url}: HTTP {status}"


def check_rq(queue_name: str, hostname: str | None = None, *, per_network: bool = False) -> str | None:
    """None when an RQ worker of this host listens on ``queue_name`` (``per_network``: on one of its
    network queues, ``<queue_name>:<network>``, as backend.queueing.relayer_queue names them)."""
    from redis import Redis, RedisError
    from rq import Worker

    url = os.environ.get("REDIS_URL", "").strip()
    if not url:
        return "REDIS_URL is not set"
    hostname = hostname or socket.gethostname()
    connection = Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)
    try:
        workers = Worker.all(connection=connection)

        def listens(names: list[str]) -> bool:
            return any(n.startswith(f"{queue_name}:") for n in names) if per_network else queue_name in names

        if any(w.hostname == hostname and listens(w.queue_names()) for w in workers):
            return None
        wanted = f"{queue_name}:<network>" if per_network else queue_name
        return f"no worker of {hostname} listens on queue {wanted!r}"
    except RedisError as exc:
        return f"redis: {exc}"
    finally:
        connection.close()


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
        problem = check_rq(os.environ.get("RELAYER_QUEUE", "").strip() or RELAYER_QUEUE_DEFAULT, per_network=True)
    else:
        print("usage: healthcheck.py http URL | worker | relayer", file=sys.stderr)
        return 2
    if problem:
        print(f"healthcheck: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
