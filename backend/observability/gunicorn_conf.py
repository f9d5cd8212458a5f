"""gunicorn settings of ``payintent serve`` (``-c python:backend.observability.gunicorn_conf``).

- **Metrics across workers.** Each worker is its own process, and a scrape reaches one of them. In
  prometheus_client's multiprocess mode every worker writes its samples to files in
  ``PROMETHEUS_MULTIPROC_DIR`` and the worker answering ``/metrics`` sums them. This module runs in
  the gunicorn master before any worker exists: it uses ``PROMETHEUS_MULTIPROC_DIR`` if set (one
  directory per ``payintent serve``; its old files are removed) or makes a private temporary one
  (removed when gunicorn exits), and the workers inherit the variable.
- **Logs.** gunicorn's own lines go through the same root handler as the app's (JSON or text by
  ``LOG_FORMAT``, secrets redacted). There is no gunicorn access log: the app logs one line per
  request with its request id, route, status and duration.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from backend.config import Settings

PRIVATE_PREFIX = "payintent-metrics-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


def private_dir() -> Path:
    """A new temporary directory named after this master's pid. Those of masters that died without
    ``on_exit`` (SIGKILL) are removed first, so they do not pile up."""
    for old in Path(tempfile.gettempdir()).glob(f"{PRIVATE_PREFIX}*-*"):
        pid = old.name.removeprefix(PRIVATE_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-"))


_given = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "").strip()
metrics_dir = Path(_given) if _given else private_dir()
metrics_dir.mkdir(parents=True, exist_ok=True)
for stale in metrics_dir.glob("*.db"):  # a previous run's samples (and dead pids) must not be summed
    stale.unlink()
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # before any worker imports prometheus_client

_settings = Settings.from_env()
_level = _settings.log_level
logconfig_dict: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "root": {"level": _level, "handlers": ["payintent"]},
    "loggers": {
        "gunicorn.error": {"level": _level, "handlers": [], "propagate": True},
        "gunicorn.access": {"level": "INFO", "handlers": [], "propagate": False},
    },
    "handlers": {
        "payintent": {
            "()": "backend.logs.make_handler",
            "fmt": _settings.log_format,
        }
    },
    "formatters": {},
}


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server: Any) -> None:
    if not _given:
        shutil.rmtree(metrics_dir, ignore_errors=True)
