"""The image's entrypoint: read secrets from files, refuse a configuration that would lose data, run the command.

``docker-compose.yml`` passes secrets as files (Docker secrets under ``/run/secrets/``), the code reads
them from the environment. For each variable below, ``<NAME>_FILE`` names a file whose contents
become ``<NAME>`` (trailing newlines removed, as the postgres image does with
``POSTGRES_PASSWORD_FILE``, so both can read the same password file):

- ``SECRET_KEY``, ``DATABASE_URL``, ``REDIS_URL``, ``METRICS_TOKEN``: settings of ``backend/config.py``;
- ``PGPASSWORD``: read by libpq, so ``DATABASE_URL`` can name no password;
- any ``*_RPC_URL`` (the ``rpc_url_env`` of a network in the chains file): RPC URLs may embed a
  provider key.

``CHAINS_FILE`` and ``RELAY_KEYS_FILE`` are not touched: the code opens those paths itself.
Setting both ``NAME`` and ``NAME_FILE`` is refused, as is an unreadable or empty file.

``payintent`` commands (but ``--help``) are refused without ``DATABASE_URL``: the code would fall
back to a SQLite file inside the container, which every replica would have on its own and a
re-created container would lose.

The health checks (``deploy/healthcheck.py``) do not run through the entrypoint and call
:func:`load_secret_files` themselves.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

FROM_FILE = ("SECRET_KEY", "DATABASE_URL", "REDIS_URL", "METRICS_TOKEN", "PGPASSWORD")
FROM_FILE_SUFFIX = "_RPC_URL"


class ConfigError(RuntimeError):
    pass


def file_variable_targets(environ: Mapping[str, str]) -> dict[str, str]:
    """``{NAME: path}`` for every ``NAME_FILE`` in ``environ`` that this entrypoint reads."""
    targets = {}
    for variable, path in environ.items():
        if not variable.endswith("_FILE") or not path.strip():
            continue
        name = variable[: -len("_FILE")]
        if name in FROM_FILE or name.endswith(FROM_FILE_SUFFIX):
            targets[name] = path.strip()
    return targets


def load_secret_files(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ``: each ``NAME`` read from the file named by ``NAME_FILE``."""
    values = {}
    for name, path in sorted(file_variable_targets(environ).items()):
        if environ.get(name, "").strip():
            raise ConfigError(f"both {name} and {name}_FILE are set: set one of them")
        try:
            value = Path(path).read_text(encoding="utf-8").rstrip("\n")
        except OSError as exc:
            raise ConfigError(f"{name}_FILE={path}: cannot read it ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{name}_FILE={path}: not UTF-8 text") from None
        if not value.strip():
            raise ConfigError(f"{name}_FILE={path}: the file is empty")
        values[name] = value
    return values


def check_command(argv: list[str], environ: Mapping[str, str]) -> None:
    if not argv:
        raise ConfigError("no command given")
    is_payintent = Path(argv[0]).name == "payintent"
    wants_help = any(arg in ("--help", "-h") for arg in argv[1:]) or len(argv) == 1
    if is_payintent and not wants_help and not environ.get("DATABASE_URL", "").strip():
        raise ConfigError(
            "DATABASE_URL (or DATABASE_URL_FILE) is not set: this image never falls back to a SQLite file "
            "inside the container"
        )


def main(argv: list[str]) -> None:
    try:
        os.environ.update(load_secret_files(os.environ))
        check_command(argv, os.environ)
    except ConfigError as exc:
        print(f"entrypoint: {exc}", file=sys.stderr)
        sys.exit(78)  # EX_CONFIG
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
