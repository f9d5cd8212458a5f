"""A relayer process's identity on this host, so a restarted relayer takes back at once the relay accounts its dead
predecessor leased (backend/rails/evm/accounts.py) instead of waiting ``LEASE_SECONDS`` for their leases to lapse.

An identity is a slot: one of the files ``relayer-<n>.lock`` of ``RELAYER_STATE_DIR``, held with an exclusive
``flock`` for the whole life of the process. The kernel frees the lock only when its holder is gone, however it went
(SIGKILL, ``os._exit``, a crash): so a process that holds a slot knows every earlier holder of that slot is dead,
and a dead process broadcasts nothing. The slot's name is a random string written in the file by its first holder,
with where it was written (``_where``: this boot of this host, this very file); a lease value starts with it, and
only a holder of the same slot takes over such a lease before it lapses. A file removed and made again (a /tmp
cleaner, an operator), replaced by a rename, copied or restored elsewhere gets a new name, so it never matches a live
holder's leases.
The directory must be local to the host (flock on a network file system may be lost while its holder lives).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import socket
import tempfile
from pathlib import Path

from backend.passwords import private_dir_usable

log = logging.getLogger(__name__)

SLOTS = 64  # relayer processes of one host sharing a directory (``payintent relayer --processes`` at most 64)


def default_state_dir() -> Path:
    """Kept across restarts: systemd's ``StateDirectory=`` (``$STATE_DIRECTORY``), else ``$PAYINTENT_VAR_DIR``,
    else a per-user directory under the temporary directory (never ``RuntimeDirectory=``: removed at each stop)."""
    for variable, name in (("STATE_DIRECTORY", "relayer-slots"), ("PAYINTENT_VAR_DIR", "relayer-slots")):
        value = os.environ.get(variable, "").split(":")[0]
        if value and os.path.isabs(value) and os.path.isdir(value):
            return Path(value) / name
    return Path(tempfile.gettempdir()) / f"payintent-relayer-slots-{os.getuid()}"


def claim(directory: Path | None = None) -> str | None:
    """This process's identity: the name in the first slot file of ``directory`` it could lock (created with a new
    name when empty), its lock held until the process ends. None when the directory is not usable or every slot is
    held (logged): the process then leases as any other, and its accounts free up only when its leases lapse."""
    directory = directory or default_state_dir()
    if not private_dir_usable(directory):
        log.warning("RELAYER_STATE_DIR %s is not usable: a restarted relayer waits for its old leases to lapse",
                    directory)  # fmt: skip
        return None
    for slot in range(SLOTS):
        fd = os.open(directory / f"relayer-{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            here = _where(fd)
            name, _, written_where = os.pread(fd, 200, 0).decode("ascii", "replace").strip().partition(" ")
            if len(name) != 32 or any(c not in "0123456789abcdef" for c in name) or written_where != here:
                name = secrets.token_hex(16)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{name} {here}".encode(), 0)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):
            os.utime(fd)  # a held slot never looks stale to an age-based cleaner
        _held.append(fd)  # never closed: the lock lasts as long as the process
        log.info("relayer identity: slot %d of %s", slot, directory)
        return name
    log.warning("RELAYER_STATE_DIR %s: all %d slots are held", directory, SLOTS)
    return None


_held: list[int] = []


def _where(fd: int) -> str:
    """Where this slot file is: this boot of this host (its kernel's boot id and its host name) and this very file
    (device and inode). A name written elsewhere (the file copied, ``cp -a``, an image or a backup restored, a
    cloned machine; or replaced by a rename, as ``sed -i`` does) is never taken for the one a live holder may be
    using: the slot gets a new name."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    stat = os.fstat(fd)
    seen = f"{boot_id}|{socket.gethostname()}|{stat.st_dev}|{stat.st_ino}"
    return hashlib.sha256(seen.encode()).hexdigest()[:32]
