"""The `payintent` admin CLI contract, run as a real subprocess against each engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from harness.ready import wait_healthy as _wait_healthy
from tests.conftest import free_port, truncate_all

PAYINTENT = str(Path(sys.executable).with_name("payintent"))


def run(db_url: str, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [PAYINTENT, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DATABASE_URL": db_url, "LOG_LEVEL": "WARNING", **(env or {})},
        cwd=cwd,
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr  # exactly one JSON object
    return proc.returncode, json.loads(lines[0]), proc.stderr


@pytest.fixture
def fresh_db(db_url: str) -> str:
    truncate_all(db_url)
    return db_url


def test_merchant_key_wallet_lifecycle(fresh_db):
    code, out, _ = run(
        fresh_db,
        "merchant",
        "create",
        "--email",
        "cli@example.com",
        "--password",
        "hunter2hunter2",
        "--name",
        "CLI Shop",
    )
    assert code == 0
    assert out["merchant_id"].startswith("mer_")
    assert re.fullmatch(r"sk_test_[0-9A-Za-z]{43,}", out["api_key"])
    merchant_id = out["merchant_id"]

    code, key, _ = run(fresh_db, "key", "create", "--merchant", merchant_id)
    assert code == 0 and key["key_id"].startswith("key_") and key["api_key"].startswith("sk_test_")
    assert key["api_key"] != out["api_key"]

    code, wallet, _ = run(
        fresh_db,
        "wallet",
        "set",
        "--merchant",
        merchant_id,
        "--network",
        "eip155:84532",
        "--address",
        "0x70997970c51812dc3a010c7d01b50e0d17dc79c8",
    )
    assert code == 0
    assert wallet["address"] == "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"

    code, revoked, _ = run(fresh_db, "key", "revoke", "--merchant", merchant_id, "--key", key["key_id"])
    assert code == 0 and revoked["revoked_at"].endswith("Z")

    code, listing, _ = run(fresh_db, "key", "list", "--merchant", merchant_id)
    assert code == 0
    assert len(listing["keys"]) == 2
    assert all("api_key" not in k and k["prefix"].startswith("sk_test_") for k in listing["keys"])
    assert sum(k["revoked_at"] is not None for k in listing["keys"]) == 1


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["merchant", "create", "--email", "bad", "--password", "hunter2hunter2"], "INVALID_EMAIL"),
        (["merchant", "create", "--email", "a@example.com", "--password", "short"], "WEAK_PASSWORD"),
        (["merchant", "create", "--email", "a@example.com"], "USAGE"),
        (["key", "create", "--merchant", "mer_nope"], "MERCHANT_NOT_FOUND"),
        (["key", "revoke", "--merchant", "mer_nope", "--key", "key_nope"], "MERCHANT_NOT_FOUND"),
        (
            ["wallet", "set", "--merchant", "mer_nope", "--network", "eip155:84532", "--address", "0x1"],
            "MERCHANT_NOT_FOUND",
        ),
        (["nonsense"], "USAGE"),
    ],
)
def test_bad_input_exits_nonzero_with_a_clear_message(fresh_db, args, code):
    status, out, stderr = run(fresh_db, *args)
    assert status != 0
    assert out["success"] is False
    assert out["error"]["code"] == code
    assert out["error"]["message"] in stderr


def test_bad_wallet_and_key_for_an_existing_merchant(fresh_db):
    _, out, _ = run(fresh_db, "merchant", "create", "--email", "w@example.com", "--password", "hunter2hunter2")
    merchant_id = out["merchant_id"]
    status, err, _ = run(
        fresh_db, "wallet", "set", "--merchant", merchant_id, "--network", "eip155:84532", "--address", "0x123"
    )
    assert status != 0 and err["error"]["code"] == "INVALID_ADDRESS"
    status, err, _ = run(
        fresh_db,
        "wallet",
        "set",
        "--merchant",
        merchant_id,
        "--network",
        "eip155:1",
        "--address",
        "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    )
    assert status != 0 and err["error"]["code"] == "UNKNOWN_NETWORK"
    status, err, _ = run(fresh_db, "key", "revoke", "--merchant", merchant_id, "--key", "key_nope")
    assert status != 0 and err["error"]["code"] == "KEY_NOT_FOUND"


def test_db_upgrade_is_idempotent(fresh_db):
    code, out, _ = run(fresh_db, "db", "upgrade")
    assert code == 0 and out["revision"]
    assert "password" not in out["database"] or "***" in out["database"]


def test_serve_runs_the_api_under_gunicorn(fresh_db):
    _, out, _ = run(fresh_db, "merchant", "create", "--email", "s@example.com", "--password", "hunter2hunter2")
    run(
        fresh_db,
        "wallet",
        "set",
        "--merchant",
        out["merchant_id"],
        "--network",
        "eip155:84532",
        "--address",
        "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    )
    port = free_port()
    proc = subprocess.Popen(
        [PAYINTENT, "serve", "--port", str(port), "--workers", "2"],
        env={**os.environ, "DATABASE_URL": fresh_db, "CHECKOUT_HOST": f"http://127.0.0.1:{port}"}
        | {"WEB_THREADS": "7", "PAY_WAIT_SECONDS": "12"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180  # a loaded machine (4 xdist workers) starts gunicorn slowly
        while True:
            try:
                if requests.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "gunicorn did not start"
            time.sleep(0.1)
        headers = {"Authorization": f"Bearer {out['api_key']}"}
        created = requests.post(f"{base}/api/v1/x402/intents", json={"amount_usdc": 2.5}, headers=headers, timeout=5)
        assert created.status_code == 201
        data = created.json()["data"]
        assert data["checkout_url"] == f"{base}/pay/{data['intent_id']}"
        read = requests.get(f"{base}/api/v1/x402/intents/{data['intent_id']}", headers=headers, timeout=5)
        assert read.json()["data"]["amount_usdc"] == 2.5
        # serve execs gunicorn (the same pid): threaded workers, WEB_THREADS each, PAY_WAIT_SECONDS + 5 s to finish.
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
        assert argv[argv.index("--worker-class") + 1] == "gthread"
        assert argv[argv.index("--threads") + 1] == "7"
        assert argv[argv.index("--graceful-timeout") + 1] == "17"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_with_database_url_set_nothing_is_written_to_the_working_directory(fresh_db, redis_url, tmp_path):
    """The image runs as uid 10001 in a working directory it cannot write to. With DATABASE_URL set, the
    start-up path of these commands writes nothing there: not PAYINTENT_VAR_DIR (the SQLite default), not
    HOME (gunicorn's control socket). chmod stops a non-root user; as root it does not, so the directory
    must also stay empty."""
    workdir = tmp_path / "readonly"
    workdir.mkdir()
    workdir.chmod(0o555)
    env = {
        "PAYINTENT_VAR_DIR": str(workdir / "var"),
        "HOME": str(workdir),
        "XDG_RUNTIME_DIR": "",
        "REDIS_URL": redis_url,
        "RELAY_KEYS": "{}",  # the relayer starts (no network has keys) and drains the empty queue
    }
    try:
        for args in (
            ["db", "upgrade"],
            ["merchant", "create", "--email", "ro@example.com", "--password", "hunter2hunter2"],
            ["worker", "--burst"],
            ["relayer", "--burst"],
        ):
            code, out, stderr = run(fresh_db, *args, env=env, cwd=workdir)
            assert code == 0, (args, out, stderr)
            assert list(workdir.iterdir()) == [], args
            if args[0] == "merchant":
                api_key = out["api_key"]

        port = free_port()
        proc = subprocess.Popen(
            [PAYINTENT, "serve", "--port", str(port), "--workers", "1"],
            env={**os.environ, "DATABASE_URL": fresh_db, **env},
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_healthy(base, [proc])
            listed = requests.get(
                f"{base}/api/v1/x402/intents", headers={"Authorization": f"Bearer {api_key}"}, timeout=10
            )
            assert listed.status_code == 200
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        assert list(workdir.iterdir()) == []
    finally:
        workdir.chmod(0o755)


SQLITE_WARNING = "DATABASE_URL is not set: using the SQLite file"
SECRET_KEY_WARNING = "SECRET_KEY is the development default"


def test_serve_worker_and_relayer_warn_about_development_settings(redis_url, tmp_path):
    """Without DATABASE_URL they still run (tests, `payintent dev`) on the SQLite file under PAYINTENT_VAR_DIR,
    and say so: in production that file is a trap (one per container, lost with it). Only serve, whose
    dashboard is the one user of SECRET_KEY, warns about its development default, and once."""
    sqlite_file = tmp_path / "var" / "payintent.db"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env |= {"PAYINTENT_VAR_DIR": str(tmp_path / "var"), "REDIS_URL": redis_url, "RELAY_KEYS": "{}"}
    env |= {"LOG_LEVEL": "WARNING", "LOG_FORMAT": "text", "SECRET_KEY": ""}
    for command in ("worker", "relayer"):
        done = subprocess.run([PAYINTENT, command, "--burst"], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stderr.count(SQLITE_WARNING) == 1, done.stderr
        assert f"{SQLITE_WARNING} {sqlite_file}, for development only" in done.stderr
        assert "set DATABASE_URL to a PostgreSQL database in production" in done.stderr
        assert SECRET_KEY_WARNING not in done.stderr, done.stderr

    logged = _serve_until_healthy(env, tmp_path)
    assert logged.count(f"{SQLITE_WARNING} {sqlite_file}") == 1, logged  # once, not once per gunicorn worker
    assert logged.count(SECRET_KEY_WARNING) == 1, logged

    named = {**env, "DATABASE_URL": f"sqlite:///{sqlite_file}"}  # the same file, named: what `payintent dev` does
    done = subprocess.run([PAYINTENT, "worker", "--burst"], env=named, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and SQLITE_WARNING not in done.stderr, done.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]"])
def test_serve_refuses_the_development_secret_key_off_loopback(tmp_path, host):
    """The development SECRET_KEY is in the source: with it, anyone who reaches the dashboard can forge a
    session. On loopback (`make run`, the tests) it is still only a warning (the test above)."""
    from backend.migrate import upgrade

    database_url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(database_url)  # a database that would serve: the refusal is about the key alone
    env = {**os.environ, "SECRET_KEY": "", "DATABASE_URL": database_url, "PAYINTENT_VAR_DIR": str(tmp_path / "var"),
           "LOG_LEVEL": "WARNING"}  # fmt: skip
    proc = subprocess.Popen([PAYINTENT, "serve", "--host", host, "--port", str(free_port()), "--workers", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.communicate(timeout=30)
        pytest.fail(f"serve started on {host} with the development SECRET_KEY")
    assert proc.returncode == 1, err
    error = json.loads(out.strip().splitlines()[-1])["error"]
    assert error["code"] == "INSECURE_SECRET_KEY"
    assert f"refusing to serve on {host}, which is not a loopback address" in error["message"]
    assert "Set SECRET_KEY" in err


@pytest.mark.parametrize(("host", "hops", "warned"), [("0.0.0.0", "0", True), ("0.0.0.0", "1", False),
                                                     ("127.0.0.1", "0", False)])  # fmt: skip
def test_serve_off_loopback_without_a_proxy_warns_about_slow_clients(tmp_path, host, hops, warned):
    """gunicorn's worker threads reachable from other machines with no proxy declared: slowloris stops them
    (tests/observability/test_slow_clients.py), so serve says it belongs behind nginx, once."""
    from backend.cli import SLOW_CLIENTS_WARNING
    from backend.migrate import upgrade

    database_url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(database_url)
    env = {**os.environ, "SECRET_KEY": "a-real-secret-key-for-this-test", "DATABASE_URL": database_url,
           "PAYINTENT_VAR_DIR": str(tmp_path / "var"), "LOG_LEVEL": "WARNING", "LOG_FORMAT": "text",
           "TRUSTED_PROXY_HOPS": hops}  # fmt: skip
    logged = _serve_until_healthy(env, tmp_path, host)
    assert logged.count(SLOW_CLIENTS_WARNING) == (1 if warned else 0), logged
    if warned:
        assert f"serving on {host}" in logged and "deploy/nginx.conf" in logged and "TRUSTED_PROXY_HOPS=1" in logged


def test_which_hosts_are_loopback(monkeypatch):
    from backend import cli

    for host in ("127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost"):
        assert cli._loopback(host), host
    for host in ("0.0.0.0", "::", "", "192.0.2.1", "2001:db8::1", "nonexistent.invalid"):
        assert not cli._loopback(host), host
    monkeypatch.setenv("SECRET_KEY", "")
    cli._refuse_development_secret_key("127.0.0.1")  # make run, the tests
    with pytest.raises(cli.CLIError, match="not a loopback address"):
        cli._refuse_development_secret_key("0.0.0.0")
    monkeypatch.setenv("SECRET_KEY", "a-real-secret-key-" + "x" * 40)
    cli._refuse_development_secret_key("0.0.0.0")  # the image, docker-compose.yml: a real key


@pytest.mark.parametrize(("error", "exit_code"), [("SERVER_BUSY", 1), ("NOT_FOUND", 2)])
def test_a_domain_error_is_a_json_error_and_an_exit_code_without_traceback(capsys, error, exit_code):
    import click

    from backend import cli
    from backend.errors import CATALOG, DomainError

    @click.command("refuse")
    def refuse() -> None:
        raise DomainError(error)  # what a service raises: the catalog's status class decides the exit code

    cli.cli.add_command(refuse)
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main(["refuse"])
    finally:
        cli.cli.commands.pop("refuse")
    out, err = capsys.readouterr()
    message = CATALOG[error].description
    assert exited.value.code == exit_code
    assert json.loads(out) == {"success": False, "error": {"code": error, "message": message}}
    assert err == f"payintent: {message}\n"


def _serve_until_healthy(env: dict[str, str], tmp_path: Path, host: str = "127.0.0.1") -> str:
    """Start `payintent serve` (2 workers) on ``host``, wait until it answers, stop it; what it logged."""
    port = free_port()
    with (tmp_path / "serve.log").open("w") as log:
        argv = [PAYINTENT, "serve", "--host", host, "--port", str(port), "--workers", "2"]
        proc = subprocess.Popen(argv, env=env, stderr=log)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", [proc])
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return (tmp_path / "serve.log").read_text()


def test_an_argument_that_is_not_utf8_is_a_usage_error_not_a_traceback(capsys):
    """`payintent merchant create --email $'\\xff@example.com'`: the shell hands bytes that are not UTF-8, Python
    keeps them as lone surrogates, and the database insert raised UnicodeEncodeError (INTERNAL_ERROR, a
    traceback). Refused before any command runs."""
    from backend import cli

    undecodable = b"\xff@example.com".decode("utf-8", "surrogateescape")
    args = ["merchant", "create", "--email", undecodable, "--password", "correct horse battery"]
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    out, err = capsys.readouterr()
    assert exited.value.code == 2
    message = "argument 4 is not valid UTF-8 text"
    assert json.loads(out) == {"success": False, "error": {"code": "USAGE", "message": message}}
    assert err == f"payintent: {message}\n"
