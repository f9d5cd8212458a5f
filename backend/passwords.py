"""At most K password hashes at once on this machine; a request that cannot get a slot soon is refused.

argon2 is meant to be expensive (about 50 ms of one core and 64 MiB per hash with argon2-cffi's
defaults). Every log-in and sign-up runs one on the request's worker, so a flood of them, from any
number of addresses and for any emails, used to pin every core and leave nothing for the checkout and
the API. Each hash now runs in one of ``LOGIN_HASH_CONCURRENCY`` slots (default: the machine's
cores), shared by every process that uses the same ``LOGIN_HASH_SLOTS_DIR``: gunicorn's workers are
processes (sync workers, one request each), so a lock inside one process would bound nothing. A slot is
an exclusive ``flock`` on one of K files; the kernel frees it when its holder exits, however it exits.
A request that finds every slot taken tries again for ``LOGIN_HASH_WAIT_SECONDS`` (default 2) and
is then answered ``503 SERVER_BUSY`` with ``Retry-After: 1``: never queued without bound.

Without a usable directory (another user owns it, a read-only file system) the bound is per process,
and a warning is logged once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from backend.errors import APIError

log = logging.getLogger(__name__)

BUSY_MESSAGE = "The server is busy checking other passwords. Try again in a few seconds."
_POLL_SECONDS = (0.005, 0.05)  # the first retry's pause, and the longest one


class PasswordCheckBusy(APIError):
    """Every password-hash slot stayed taken for the whole wait: 503 SERVER_BUSY, ``Retry-After: 1``."""

    def __init__(self) -> None:
        super().__init__(503, "SERVER_BUSY", BUSY_MESSAGE, headers={"Retry-After": "1"})


def default_slots_dir() -> Path:
    """Shared by every payintent process of this user on this machine (a per-user temporary directory)."""
    return Path(tempfile.gettempdir()) / f"payintent-password-slots-{os.getuid()}"


def _usable(directory: Path) -> bool:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
    except OSError:
        return False
    # Another user's directory could hold our slots for ever: refuse it (and a symlink).
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


class HashGate:
    """K slots, each an exclusive lock on a file of ``directory`` (or a process-local semaphore)."""

    def __init__(self, slots: int, wait_seconds: float, directory: Path | None) -> None:
        self.slots = max(1, slots)
        self.wait_seconds = max(0.0, wait_seconds)
        self.directory = directory if directory is not None and _usable(directory) else None
        if directory is not None and self.directory is None:
            log.warning("LOGIN_HASH_SLOTS_DIR %s is not usable: password hashes are bounded per process", directory)
        self._local = threading.BoundedSemaphore(self.slots)

    def _try_file_slot(self) -> int | None:
        assert self.directory is not None
        first = random.randrange(self.slots)
        for n in range(self.slots):
            path = self.directory / f"slot-{(first + n) % self.slots}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            return fd
        return None

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the ``with`` block; :class:`PasswordCheckBusy` when none frees up in time."""
        deadline = time.monotonic() + self.wait_seconds
        if self.directory is None:
            if not self._local.acquire(timeout=self.wait_seconds):
                raise PasswordCheckBusy()
            try:
                yield
            finally:
                self._local.release()
            return
        pause = _POLL_SECONDS[0]
        while (fd := self._try_file_slot()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PasswordCheckBusy()
            time.sleep(min(pause, remaining) * random.uniform(0.5, 1.0))
            pause = min(pause * 2, _POLL_SECONDS[1])
        try:
            yield
        finally:
            os.close(fd)  # closing the only descriptor of this open file releases its lock


_gate = HashGate(os.cpu_count() or 1, 2.0, None)


def configure(slots: int, wait_seconds: float, directory: str | None) -> HashGate:
    """Set the process's gate (``create_app`` calls it with the settings); ``slots`` 0: one per core."""
    global _gate
    _gate = HashGate(slots or os.cpu_count() or 1, wait_seconds, Path(directory) if directory else default_slots_dir())
    return _gate


def slot() -> contextlib.AbstractContextManager[None]:
    """A slot of the process's gate: ``with passwords.slot(): hasher.verify(...)``."""
    return _gate.slot()
