"""A relayer's identity slot (backend.rails.evm.identity): the same name only for the same file on this boot of this
host, so a copy of a slot (cp -a, an image, a backup) or a file replaced by a rename never takes over the leases of
a live holder of the original (review: two live processes sharing a name took each other's accounts)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.rails.evm import identity


@pytest.fixture(autouse=True)
def _let_go() -> Iterator[None]:
    """The slots this test claimed are given up at its end (a process holds its own until it dies)."""
    before = len(identity._held)
    yield
    while len(identity._held) > before:
        os.close(identity._held.pop())


def _die() -> None:
    """The last claimant's death, as the kernel sees it: its lock is gone."""
    os.close(identity._held.pop())


def _slots(tmp_path: Path) -> Path:
    directory = tmp_path / "slots"
    directory.mkdir(mode=0o700)
    return directory


def test_a_restart_after_a_death_gets_the_dead_ones_name(tmp_path):
    directory = _slots(tmp_path)
    name = identity.claim(directory)
    assert name is not None and identity.claim(directory) != name  # the slot is held: the next one, another name
    _die()
    _die()
    assert identity.claim(directory) == name


def test_a_copy_of_a_held_slot_gets_a_name_of_its_own(tmp_path):
    directory = _slots(tmp_path)
    name = identity.claim(directory)  # held, alive
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy, copy_function=shutil.copy2)
    assert identity.claim(copy) not in (None, name)


def test_a_slot_file_replaced_by_a_rename_gets_a_new_name(tmp_path):
    directory = _slots(tmp_path)
    name = identity.claim(directory)
    _die()
    slot = directory / "relayer-0.lock"
    edited = directory / "edited"
    edited.write_bytes(slot.read_bytes())  # what sed -i does: a new file, renamed over the old one
    edited.replace(slot)
    assert identity.claim(directory) not in (None, name)
