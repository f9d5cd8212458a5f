"""End-to-end fixtures: the whole local stack (`payintent dev`) and headless Chromium driving it.

``stack`` starts ``payintent dev`` once per session, exactly as ``make run`` does (SQLite and a
private Redis under a temporary var/, the local devnet, the relayer and the worker) and reads the
demo merchant from var/demo.json (the local stack harness's ``harness.dev``). The browser is Debian's
Chromium (``CHROMIUM``, else ``chromium`` on PATH, else /usr/bin/chromium), never a Playwright download.
Every test that uses ``page`` leaves a screenshot of where it ended in ``e2e/artifacts/<test name>.png``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
from playwright.sync_api import BrowserContext, Page

from harness.dev import DevStack, start_dev
from harness.errors import HarnessError
from tests.webhooks.receiver import Receiver, start_receiver

E2E_DIR = Path(__file__).resolve().parent
ARTIFACTS = E2E_DIR / "artifacts"
STARTUP_TIMEOUT = 120.0
DEFAULT_TIMEOUT_MS = 15_000  # each Playwright action or expectation; a stuck page fails fast
VIEWPORT = {"width": 1280, "height": 800}
T = TypeVar("T")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.e2e)
            # pytest-xdist (--dist loadgroup): every e2e test on one worker, so one `payintent dev` and one
            # Chromium serve them all.
            item.add_marker(pytest.mark.xdist_group("e2e"))


# --- the stack ---------------------------------------------------------------------------------------

Stack = DevStack  # a running `payintent dev` (harness.dev): base_url, demo, api(), create_intent(), log()


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """``payintent dev`` on a free port with a temporary var/, up for the whole session."""
    workdir = Path(tempfile.mkdtemp(prefix="payintent-e2e-"))
    try:
        try:
            running = start_dev(workdir, timeout=STARTUP_TIMEOUT)
        except HarnessError as exc:
            pytest.fail(str(exc))
        try:
            yield running
        finally:
            running.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A local webhook receiver (tests/webhooks/receiver.py); ``payintent dev`` allows private targets."""
    started = start_receiver()
    yield started
    started.close()


# --- the browser ---------------------------------------------------------------------------------


def chromium_path() -> str:
    for candidate in (os.environ.get("CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        "The e2e tests need Chromium and found none: install it (Debian: apt-get install chromium, "
        "or `make test`, which does) or set CHROMIUM=/path/to/chromium.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    """pytest-playwright's launch options, with Debian's Chromium instead of Playwright's download."""
    return {**browser_type_launch_args, "executable_path": chromium_path(), "headless": True, "args": CHROMIUM_ARGS}


@pytest.fixture(scope="session")
def base_url(stack: Stack) -> str:
    """Relative ``page.goto("/dashboard/login")`` goes to the stack."""
    return stack.base_url


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args: dict[str, Any]) -> dict[str, Any]:
    return {**browser_context_args, "viewport": VIEWPORT}


@pytest.fixture
def page(context: BrowserContext) -> Page:
    """pytest-playwright's page, failing after 15 s instead of 30 s when something never appears."""
    new_page = context.new_page()
    new_page.set_default_timeout(DEFAULT_TIMEOUT_MS)
    return new_page


# --- screenshots ---------------------------------------------------------------------------------


_SAFE = re.compile(r"[^\w.-]+")


def _file_name(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"\[chromium\]$", "", request.node.name)  # the only browser: not worth a name part
    name = name.replace("[chromium-", "[").replace("-chromium]", "]")
    return _SAFE.sub("_", name).strip("_")


class Shot(Protocol):
    def __call__(self, page: Page, name: str | None = None) -> Path: ...


@pytest.fixture
def shot(request: pytest.FixtureRequest) -> Shot:
    """``shot(page)`` saves ``e2e/artifacts/<test name>.png``; ``shot(page, "step")`` ``<test name>-step.png``."""

    def take(page: Page, name: str | None = None) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        stem = _file_name(request) + ("-" + _SAFE.sub("_", name) if name else "")
        path = ARTIFACTS / f"{stem}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take


@pytest.fixture(autouse=True)
def _final_screenshot(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that used ``page`` leaves ``e2e/artifacts/<test name>.png`` of where it ended, pass or fail."""
    if "page" not in request.fixturenames:
        yield
        return
    page: Page = request.getfixturevalue("page")  # set up first, so both are still there at our teardown
    take: Shot = request.getfixturevalue("shot")
    yield
    if not page.is_closed():
        try:
            take(page)
        except Exception as exc:  # a crashed page must not hide the test's own outcome
            print(f"e2e: no final screenshot: {exc}", file=sys.stderr)


def poll(check: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.1) -> T:
    """Call ``check`` until it returns something truthy (short interval), then return that."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {timeout} s: {getattr(check, '__name__', check)}")
        time.sleep(interval)
