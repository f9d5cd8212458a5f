from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.webhooks.helpers import HUNG_SUFFIX
from tests.webhooks.receiver import Receiver, start_receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = start_receiver()
    yield running
    running.close()


@pytest.fixture
def hung_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A name server that never answers, for names under HUNG_SUFFIX: the one part that cannot run here
    (it would need a server on port 53 and the machine's resolver configuration). ``socket.getaddrinfo``
    blocks for those names until the test ends, as a lookup to a silent server does (it cannot be
    cancelled); every other name resolves as usual. Yields the hung names looked up, in order."""
    real = socket.getaddrinfo
    release = threading.Event()
    asked: list[str] = []

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name.endswith(HUNG_SUFFIX):
            asked.append(name)
            release.wait()
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield asked
    release.set()
