"""The login throttle under simultaneous guesses: the limits hold however many arrive at once.

A password check (argon2) takes a noticeable fraction of a second. When the limits were read before
the check and the failure counted after it, every guess sent in the same instant saw the count
below the limit: 24 guesses at once through 4 gunicorn workers got 12-13 password checks against a
limit of 10. Now each attempt reserves its failure (an atomic increment in Redis) before the check.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from backend.extensions import db
from tests.conftest import create_merchant, make_settings, truncate_all
from tests.dashboard.helpers import PASSWORD, log_in, log_out, token

EMAIL = "shop@example.com"
ACCOUNT_MAX_FAILURES = 10  # security.ACCOUNT_MAX_FAILURES (a literal: this module also runs on the base commit)
LOGIN_MAX_FAILURES = 5  # per (email, address)
BURST = 24


def _from(address: str) -> dict[str, Any]:
    return {"REMOTE_ADDR": address}


@pytest.fixture(autouse=True)
def _real_password_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """argon2 with its real cost here (the suite's is the cheapest, tests/conftest.py): the races need its time."""
    from argon2 import PasswordHasher

    from backend.merchants import services as merchants

    monkeypatch.setattr(merchants, "_hasher", PasswordHasher())


@pytest.fixture
def two_processes(db_url: str, chains: Any, redis_url: str) -> Any:
    """Two apps on one Redis stand for two API processes; ``merchant`` is created through the first."""
    from backend.app import create_app

    truncate_all(db_url)
    settings = make_settings(db_url, redis_url=redis_url)
    apps = [create_app(settings, chains=chains), create_app(settings, chains=chains)]
    with apps[0].app_context():
        create_merchant(apps[0], EMAIL)
        db.session.remove()
    yield apps
    for app in apps:
        with app.app_context():
            db.session.remove()
            db.engine.dispose()


def _at_once(apps: list[Any], attempts: list[tuple[Any, str, dict[str, Any]]], password_of: Any) -> list[int]:
    """Post every log-in at the same instant (a barrier), each through its app; the status codes in order.

    ``attempts``: (client, CSRF token, environ) per attempt; ``password_of(i)`` the password attempt i sends.
    """
    barrier = threading.Barrier(len(attempts))
    codes: list[int] = [0] * len(attempts)
    errors: list[BaseException] = []

    def attempt(i: int) -> None:
        client, csrf, environ = attempts[i]
        app = apps[i % len(apps)]
        try:
            barrier.wait(timeout=60)
            with app.app_context():
                response = client.post(
                    "/dashboard/login",
                    data={"csrf_token": csrf, "email": EMAIL, "password": password_of(i)},
                    environ_base=environ,
                )
                codes[i] = response.status_code
                db.session.remove()
        except BaseException as exc:  # reported below, with the test's own assertion message
            errors.append(exc)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(attempts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert all(not thread.is_alive() for thread in threads)
    return codes


def _browsers(apps: list[Any], addresses: list[str]) -> list[tuple[Any, str, dict[str, Any]]]:
    """A fresh browser per address, with its CSRF token fetched in advance (from the app it will post to)."""
    browsers = []
    for i, address in enumerate(addresses):
        app = apps[i % len(apps)]
        with app.app_context():
            client = app.test_client()
            browsers.append((client, token(client), {"REMOTE_ADDR": address}))
            db.session.remove()
    return browsers


def test_simultaneous_guesses_from_many_addresses_get_at_most_the_per_email_limit(two_processes):
    apps = two_processes
    attackers = _browsers(apps, [f"198.51.100.{n + 1}" for n in range(BURST)])
    codes = _at_once(apps, attackers, lambda i: f"guess number {i}!")
    checked, refused = codes.count(400), codes.count(429)
    assert checked + refused == BURST, codes
    assert checked <= ACCOUNT_MAX_FAILURES, f"{checked} of {BURST} simultaneous guesses had the password checked"
    assert checked == ACCOUNT_MAX_FAILURES  # and the refused ones did not use up more than the limit
    with apps[1].app_context():  # the next guess, the right password too, waits for the window
        assert log_in(apps[1].test_client(), EMAIL, PASSWORD, environ_base=_from("203.0.113.99")).status_code == 429
        db.session.remove()


def test_simultaneous_guesses_from_one_address_get_at_most_the_per_address_limit(two_processes):
    apps = two_processes
    attackers = _browsers(apps, ["198.51.100.7"] * 12)
    codes = _at_once(apps, attackers, lambda i: f"guess number {i}!")
    assert codes.count(400) == LOGIN_MAX_FAILURES and codes.count(429) == 12 - LOGIN_MAX_FAILURES, codes
    # The refused attempts did not count against the email: other addresses still have its remaining guesses.
    with apps[0].app_context():
        for n in range(ACCOUNT_MAX_FAILURES - LOGIN_MAX_FAILURES):
            response = log_in(apps[0].test_client(), EMAIL, "still guessing!", environ_base=_from(f"192.0.2.{n + 1}"))
            assert response.status_code == 400, n
        db.session.remove()


def test_the_owner_on_a_known_browser_logs_in_during_a_burst(two_processes):
    """The owner's browser (device cookie) is not refused by the per-email count the attacker is raising."""
    apps = two_processes
    with apps[0].app_context():
        owner = apps[0].test_client()
        assert log_in(owner, EMAIL, environ_base=_from("203.0.113.7")).status_code == 302
        log_out(owner)
        db.session.remove()
    attempts = _browsers(apps, [f"198.51.100.{n + 1}" for n in range(BURST)])
    with apps[0].app_context():
        attempts.append((owner, token(owner), _from("203.0.113.7")))
        db.session.remove()
    owner_index = len(attempts) - 1
    codes = _at_once(apps, attempts, lambda i: PASSWORD if i == owner_index else f"guess number {i}!")
    assert codes[owner_index] == 302, codes
    assert codes[:owner_index].count(400) <= ACCOUNT_MAX_FAILURES, codes


def test_a_success_takes_back_only_its_own_reservation(two_processes):
    """The owner's log-ins between guesses neither count as failures nor forgive the attacker's."""
    apps = two_processes
    with apps[0].app_context():
        for n in range(ACCOUNT_MAX_FAILURES - 1):
            assert (
                log_in(
                    apps[0].test_client(), EMAIL, f"guess {n}!!!!!", environ_base=_from(f"192.0.2.{n + 1}")
                ).status_code
                == 400
            )
        for _ in range(3):  # new browsers each time, so no device cookie helps
            assert log_in(apps[0].test_client(), EMAIL, PASSWORD, environ_base=_from("203.0.113.50")).status_code == 302
        assert (
            log_in(apps[0].test_client(), EMAIL, "the tenth guess", environ_base=_from("192.0.2.200")).status_code
            == 400
        )
        assert log_in(apps[0].test_client(), EMAIL, PASSWORD, environ_base=_from("203.0.113.51")).status_code == 429
        db.session.remove()


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "redis"])
def test_release_never_goes_below_zero_nor_revives_an_expired_counter(clock, redis_url, shared):
    from redis import Redis

    from backend.ephemeral import MemoryStore, RedisStore

    store = RedisStore(Redis.from_url(redis_url)) if shared else MemoryStore()
    store.release("never-counted")
    assert store.count("never-counted") == (0, 0)
    assert store.incr("c", 60) == 1 and store.incr("c", 60) == 2
    store.release("c")
    store.release("c")
    store.release("c")
    assert store.count("c")[0] == 0
    assert store.incr("c", 60) == 1  # the window goes on
    if shared:
        Redis.from_url(redis_url).delete("payintent:ephemeral:c")  # expired
    else:
        clock.advance(seconds=61)
    store.release("c")
    assert store.count("c") == (0, 0)
