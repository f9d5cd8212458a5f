"""At most K password hashes at once on this machine; a request that cannot get a slot soon is refused.

argon2 is meant to be expensive (about 50 ms of one core and 64 MiB per hash with argon2-cffi's
defaults). Every log-in and sign-up runs one on the request's worker, so a flood of them, from any
number of addresses and for any emails, used to pin every core and leave nothing for the checkout and
the API. Each hash now runs in one of ``LOGIN_HASH_CONCURRENCY`` slots (default: the machine's
cores), shared by every process that uses the same ``LOGIN_HASH_SLOTS_DIR``: gunicorn's workers are
processes (each with its threads), so a lock inside one process would bound little. A slot is
an exclusive ``flock`` on one of K files; the kernel frees it when its holder exits, however it exits.
A request that finds every slot taken tries again for ``LOGIN_HASH_WAIT_SECONDS`` (default 2) and
is then answered ``503 SERVER_BUSY`` with ``Retry-After: 1``: never queued without bound.

The default directory is private to the user and out of reach of /tmp cleaners where the platform gives
one: systemd's ``RuntimeDirectory=`` (``$RUNTIME_DIRECTORY``), else ``$XDG_RUNTIME_DIR``, else
``$PAYINTENT_VAR_DIR/password-slots``, else a per-user directory under the temporary directory. A slot file
is touched each time it is taken, so an age-based cleaner never sees a busy one as stale. If the directory
disappears while the api runs (a cleaner, an operator), it is created again, with the same checks, on the
next hash. Without a usable directory (another user owns it, a read-only file system) the bound is per
process, and a warning is logged once: never an error answer.
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

from backend.errors import DomainError

log = logging.getLogger(__name__)

BUSY_MESSAGE = "The server is busy checking other passwords. Try again in a few seconds."
_POLL_SECONDS = (0.005, 0.05)  # the first retry's pause, and the longest one


class PasswordCheckBusy(DomainError):
    """Every password-hash slot stayed taken for the whole wait: 503 SERVER_BUSY, ``Retry-After: 1``."""

    def __init__(self) -> None:
        super().__init__("SERVER_BUSY", BUSY_MESSAGE, headers={"Retry-After": "1"})


def default_slots_dir() -> Path:
    """Shared by every payintent process of this user with the same environment (gunicorn's workers inherit it)."""
    for variable, name in (
        ("RUNTIME_DIRECTORY", "password-slots"),  # systemd RuntimeDirectory=: private, removed at stop
        ("XDG_RUNTIME_DIR", "payintent-password-slots"),  # /run/user/<uid>: private, no age cleaning
        ("PAYINTENT_VAR_DIR", "password-slots"),
    ):
        value = os.environ.get(variable, "").split(":")[0]
        if value and os.path.isabs(value) and os.path.isdir(value):
            return Path(value) / name
    return Path(tempfile.gettempdir()) / f"payintent-password-slots-{os.getuid()}"


def private_dir_usable(directory: Path) -> bool:
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
        self.directory = directory if directory is not None and private_dir_usable(directory) else None
        if directory is not None and self.directory is None:
            log.warning("LOGIN_HASH_SLOTS_DIR %s is not usable: password hashes are bounded per process", directory)
        self._local = threading.BoundedSemaphore(self.slots)

    def _open(self, path: Path) -> int:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    def _try_file_slot(self) -> int | None:
        """A locked slot file's descriptor, None when every slot is taken; OSError when the directory fails."""
        assert self.directory is not None
        first = random.randrange(self.slots)
        for n in range(self.slots):
            fd = self._open(self.directory / f"slot-{(first + n) % self.slots}.lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            with contextlib.suppress(OSError):
                os.utime(fd)  # a busy slot never looks stale to an age-based /tmp cleaner
            return fd
        return None

    def _try_slot_or_recover(self) -> int | None:
        """:meth:`_try_file_slot` in the directory, checked (and created again if it is gone: a /tmp cleaner, an
        operator) each time, a syscall or two beside a ~50 ms hash; if it cannot be used any more (another user's
        now, not a directory), fall back to the per-process bound, logged once, rather than fail the request."""
        directory = self.directory
        assert directory is not None
        error: OSError | None = None
        for _ in range(2):  # a directory removed between the check and the open: once more
            if not private_dir_usable(directory):
                break
            try:
                return self._try_file_slot()
            except OSError as exc:
                error = exc
        self.directory = None
        log.warning(
            "LOGIN_HASH_SLOTS_DIR %s is not usable any more (%s): password hashes are bounded per process from now on",
            directory,
            error or "not a private directory of this user",
        )
        return None

    @contextlib.contextmanager
    def _local_slot(self, timeout: float) -> Iterator[None]:
        if not self._local.acquire(timeout=max(0.0, timeout)):
            raise PasswordCheckBusy()
        try:
            yield
        finally:
            self._local.release()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the ``with`` block; :class:`PasswordCheckBusy` when none frees up in time."""
        deadline = time.monotonic() + self.wait_seconds
        pause = _POLL_SECONDS[0]
        fd = None
        while self.directory is not None and (fd := self._try_slot_or_recover()) is None:
            # _try_slot_or_recover may give the directory up; mypy keeps the loop condition's narrowing of it.
            if self.directory is None:
                break  # type: ignore[unreachable]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PasswordCheckBusy()
            time.sleep(min(pause, remaining) * random.uniform(0.5, 1.0))
            pause = min(pause * 2, _POLL_SECONDS[1])
        if fd is None:  # no usable directory: the per-process bound
            with self._local_slot(deadline - time.monotonic()):
                yield
            return
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
