"""The hash-slot directory (LOGIN_HASH_SLOTS_DIR) failing under a running api (review3, L1 and an Info).

The directory was checked once, at start: once a /tmp cleaner (or an operator) removed it, every log-in and
sign-up was a 500 until a restart. Now it is created again on demand with the same checks, a directory that
cannot be used any more turns the bound per process (logged once) instead of failing requests, busy slot files
are touched so an age-based cleaner never takes them for stale, and the default is a private per-user runtime
directory where the platform gives one, not a predictable name in the shared /tmp.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend import passwords
from tests.conftest import create_merchant, make_settings, truncate_all
from tests.dashboard.helpers import PASSWORD, log_in, sign_up

EMAIL = "shop@example.com"


@pytest.fixture
def slots(tmp_path: Path) -> Path:
    return tmp_path / "slots"


@pytest.fixture
def slots_app(db_url: str, chains: Any, slots: Path) -> Iterator[Any]:
    from backend.app import create_app
    from backend.extensions import db

    truncate_all(db_url)
    settings = make_settings(db_url, login_hash_concurrency=2, login_hash_slots_dir=str(slots))
    application = create_app(settings, chains=chains)
    with application.app_context():
        create_merchant(application, EMAIL)
        yield application
        db.session.remove()
        db.engine.dispose()


def test_a_removed_slots_directory_is_created_again(slots_app: Any, slots: Path) -> None:
    """The review's proof: after `rmtree` of the directory every log-in and sign-up was a 500."""
    client = slots_app.test_client()
    assert log_in(client, EMAIL, "wrong password").status_code == 400
    shutil.rmtree(slots)  # what a /tmp cleaner does to a directory left alone long enough
    assert log_in(client, EMAIL, "wrong password").status_code == 400
    assert slots.is_dir() and (slots.stat().st_mode & 0o777) == 0o700
    assert sign_up(slots_app.test_client(), "new@example.com").status_code == 302
    assert log_in(slots_app.test_client(), EMAIL, PASSWORD).status_code == 302
    assert passwords._gate.directory == slots  # still the machine-wide bound


def test_a_slots_directory_that_cannot_be_used_any_more_falls_back_per_process(
    slots_app: Any, slots: Path, caplog: Any
) -> None:
    client = slots_app.test_client()
    assert log_in(client, EMAIL, "wrong password").status_code == 400
    shutil.rmtree(slots)
    slots.write_text("not a directory")  # cannot be created again
    with caplog.at_level(logging.WARNING, logger="backend.passwords"):
        assert log_in(client, EMAIL, "wrong password").status_code == 400
        assert log_in(client, EMAIL, "wrong password").status_code == 400
        assert sign_up(slots_app.test_client(), "new@example.com").status_code == 302
    assert passwords._gate.directory is None
    assert sum("bounded per process" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_a_squatted_slots_directory_is_refused_when_it_comes_back(slots_app: Any, slots: Path) -> None:
    """Re-created with the same checks: a directory others may write to is not used (the bound goes per process)."""
    assert log_in(slots_app.test_client(), EMAIL, "wrong password").status_code == 400
    shutil.rmtree(slots)
    slots.mkdir(mode=0o777)
    slots.chmod(0o777)  # another local user's doing
    assert log_in(slots_app.test_client(), EMAIL, "wrong password").status_code == 400
    assert passwords._gate.directory is None
    assert not list(slots.iterdir())  # no slot file was made there


def test_a_busy_slot_file_is_touched_so_an_age_based_cleaner_leaves_it(tmp_path: Path) -> None:
    gate = passwords.HashGate(1, 0, tmp_path)
    with gate.slot():
        pass
    slot_file = tmp_path / "slot-0.lock"
    old = time.time() - 30 * 86400
    os.utime(slot_file, (old, old))
    with gate.slot():
        assert slot_file.stat().st_mtime > time.time() - 60


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"RUNTIME_DIRECTORY": "run"}, "run/password-slots"),
        ({"XDG_RUNTIME_DIR": "xdg", "PAYINTENT_VAR_DIR": "var"}, "xdg/payintent-password-slots"),
        ({"PAYINTENT_VAR_DIR": "var"}, "var/password-slots"),
    ],
)
def test_the_default_directory_is_a_private_runtime_one(
    tmp_path: Path, monkeypatch: Any, environment: dict[str, str], expected: str
) -> None:
    for variable in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR", "PAYINTENT_VAR_DIR"):
        monkeypatch.delenv(variable, raising=False)
    for variable, name in environment.items():
        (tmp_path / name).mkdir()
        monkeypatch.setenv(variable, str(tmp_path / name))
    assert passwords.default_slots_dir() == tmp_path / expected


def test_without_a_runtime_directory_the_default_is_per_user_in_the_temporary_directory(monkeypatch: Any) -> None:
    for variable in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR", "PAYINTENT_VAR_DIR"):
        monkeypatch.delenv(variable, raising=False)
    assert passwords.default_slots_dir().name == f"payintent-password-slots-{os.getuid()}"
