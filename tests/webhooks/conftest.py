from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.webhooks.receiver import Receiver, start_receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = start_receiver()
    yield running
    running.close()
