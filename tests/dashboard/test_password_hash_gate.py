"""A flood of log-ins cannot pin every core: at most LOGIN_HASH_CONCURRENCY argon2 hashes run at once on the
machine (slots shared by every process through file locks); a request that finds no slot within
LOGIN_HASH_WAIT_SECONDS is answered 503 with Retry-After and a clear message, and counts as no failure.

The real argon2 runs; the test wraps it to count how many run at once and to hold them until it has seen the
excess refused (a hash takes ~50 ms, too short to make the overlap certain otherwise).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from argon2 import PasswordHasher

from backend import passwords
from tests.conftest import create_merchant, make_settings, truncate_all
from tests.dashboard.helpers import PASSWORD, form_token, log_in, text

EMAIL = "shop@example.com"
SLOTS = 2
FLOOD = 8


class CountingHasher:
    """The real argon2, counting the hashes in progress; each waits for ``go`` before it finishes."""

    def __init__(self) -> None:
        self.real = PasswordHasher()
        self.lock = threading.Lock()
        self.active = self.peak = self.started = 0
        self.go = threading.Event()

    def _run(self, call: Any, *args: Any) -> Any:
        with self.lock:
            self.active += 1
            self.started += 1
            self.peak = max(self.peak, self.active)
        try:
            self.go.wait(20)
            return call(*args)
        finally:
            with self.lock:
                self.active -= 1

    def hash(self, password: str) -> str:
        return self._run(self.real.hash, password)  # type: ignore[no-any-return]

    def verify(self, password_hash: str, password: str) -> bool:
        return self._run(self.real.verify, password_hash, password)  # type: ignore[no-any-return]


@pytest.fixture
def gated_app(db_url: str, chains: Any, tmp_path: Path) -> Iterator[Any]:
    from backend.app import create_app
    from backend.dashboard import services
    from backend.extensions import db

    truncate_all(db_url)
    settings = make_settings(
        db_url, login_hash_concurrency=SLOTS, login_hash_wait_seconds=0.3, login_hash_slots_dir=str(tmp_path)
    )
    application = create_app(settings, chains=chains)
    with application.app_context():
        create_merchant(application, EMAIL)
        services._dummy_hash()  # made once per process, before the hasher is counted
        yield application
        db.session.remove()
        db.engine.dispose()


def test_a_flood_of_logins_runs_at_most_k_hashes_and_refuses_the_rest(gated_app: Any, monkeypatch: Any) -> None:
    from backend.merchants import services as merchants

    counting = CountingHasher()
    monkeypatch.setattr(merchants, "_hasher", counting)
    clients = [gated_app.test_client() for _ in range(FLOOD)]
    tokens = [form_token(text(c.get("/dashboard/login"))) for c in clients]  # GETs: no hash
    results: list[Any] = [None] * FLOOD

    def attempt(n: int) -> None:
        data = {"csrf_token": tokens[n], "email": EMAIL if n % 2 else f"nobody{n}@example.com", "password": "guess!!!"}
        results[n] = clients[n].post("/dashboard/login", data=data, environ_base={"REMOTE_ADDR": f"203.0.113.{n + 1}"})

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(FLOOD)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    while sum(r is not None for r in results) < FLOOD - SLOTS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counting.active == SLOTS  # the slots are held while the excess is refused
    counting.go.set()
    for thread in threads:
        thread.join(20)

    assert counting.peak == SLOTS
    assert counting.started == SLOTS
    statuses = sorted(r.status_code for r in results)
    assert statuses == [400] * SLOTS + [503] * (FLOOD - SLOTS)
    for response in results:
        if response.status_code == 503:
            assert response.headers["Retry-After"] == "1"
            assert "busy checking other passwords" in text(response)
    # A refusal is not a failure: the owner, 8 requests later, is not throttled and logs in.
    counting.go.set()
    assert log_in(gated_app.test_client(), EMAIL, PASSWORD).status_code == 302


def test_sign_up_is_refused_with_503_when_no_slot_frees_up(gated_app: Any, tmp_path: Path) -> None:
    from tests.dashboard.helpers import sign_up

    holders = [passwords.HashGate(SLOTS, 0, tmp_path).slot() for _ in range(SLOTS)]
    for holder in holders:
        holder.__enter__()
    try:
        response = sign_up(gated_app.test_client(), "new@example.com")
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert "busy checking other passwords" in text(response)
    finally:
        for holder in holders:
            holder.__exit__(None, None, None)
    assert sign_up(gated_app.test_client(), "new@example.com").status_code == 302


def test_slots_are_shared_between_processes_and_freed_when_a_holder_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from backend.passwords import HashGate\n"
         f"with HashGate(1, 0, Path({str(tmp_path)!r})).slot():\n"
         "    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        gate = passwords.HashGate(1, 0.2, tmp_path)
        started = time.monotonic()
        with pytest.raises(passwords.PasswordCheckBusy) as refused, gate.slot():
            pass
        assert 0.15 < time.monotonic() - started < 5
        assert refused.value.http_status == 503 and refused.value.code == "SERVER_BUSY"
    finally:
        holder.kill()  # killed, not stopped: the kernel frees its lock
        holder.wait()
    with passwords.HashGate(1, 1, tmp_path).slot():
        pass


def test_a_directory_of_another_user_or_writable_by_others_is_not_used(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert passwords.HashGate(2, 0, shared).directory is None  # bounded per process instead
    assert passwords.HashGate(2, 0, tmp_path / "own").directory == tmp_path / "own"
