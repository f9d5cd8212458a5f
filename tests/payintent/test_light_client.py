"""clients/python is a distribution of its own: installed into a fresh virtual environment with only the
dependencies it declares, ``payintent`` and its modules import, and none of the service's libraries is there.

Nothing is downloaded: the client's wheel is built from the checkout, and its declared dependencies (walked through
their metadata, markers evaluated, extras left out) are the ones this environment has installed, made visible to
the fresh environment one top-level package at a time.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "python"
SERVICE_LIBRARIES = ("flask", "sqlalchemy", "gunicorn", "web3", "psycopg2", "rq", "redis", "alembic", "backend")
CLIENT_MODULES = ("payintent", "payintent.client", "payintent.agent", "payintent.webhooks", "payintent.eip3009",
                  "payintent.x402", "payintent.paywall", "payintent.access")  # fmt: skip


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` need, transitively, as installed here (no extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = requirement.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    return seen


def _footprint(name: str) -> set[str]:
    """What a distribution installed at the top of site-packages: its packages, modules and extension modules, and
    its .dist-info (libraries read their own version through importlib.metadata)."""
    return {f.parts[0] for f in metadata.distribution(name).files or []
            if f.parts[0] not in ("..", "__pycache__", "bin")}  # fmt: skip


def test_the_client_installs_and_imports_without_the_service(tmp_path: Path):
    declared = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = _closure(declared)
    assert not needed & {"flask", "sqlalchemy", "gunicorn", "web3", "psycopg2-binary", "rq", "redis"}, needed

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(wheels), str(CLIENT)], check=True, capture_output=True)  # fmt: skip
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    (wheel,) = wheels.glob("payintent_client-*.whl")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", str(wheel)],
                   check=True, capture_output=True)  # fmt: skip

    # The declared dependencies, and only those, visible to the fresh environment.
    deps = tmp_path / "deps"
    deps.mkdir()
    site = Path(metadata.distribution("requests").locate_file(""))
    for name in needed:
        for top in _footprint(name):
            if (site / top).exists() and not (deps / top).exists():
                (deps / top).symlink_to(site / top)
    (site_of_venv,) = (venv / "lib").glob("python3*/site-packages")
    (site_of_venv / "declared_dependencies.pth").write_text(str(deps) + "\n")

    probe = (
        "import importlib, importlib.util, json, sys\n"
        f"for module in {CLIENT_MODULES!r}: importlib.import_module(module)\n"
        f"present = [m for m in {SERVICE_LIBRARIES!r} if importlib.util.find_spec(m) is not None]\n"
        "print(json.dumps({'present': present, 'payintent': sys.modules['payintent'].__file__}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = __import__("json").loads(done.stdout)
    assert answer["present"] == [], answer  # none of the service's libraries
    assert answer["payintent"].startswith(str(site_of_venv)), answer  # the installed wheel, not the checkout
