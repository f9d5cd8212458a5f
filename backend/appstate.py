"""Typed per-app state: what ``create_app`` binds to an app, and one typed accessor for each.

Flask keeps per-app objects in two string-keyed dicts, ``app.config`` and ``app.extensions``. Code never
indexes them: :func:`init_app` stores, the accessors below read, and the type checker knows what each gives.
Every accessor reads the current app (``flask.current_app``) unless it is handed one (CLI commands, worker
mains and tests hold an app outside any app context).

A module that keeps its own per-app object (a lazily made connection, an in-process store) declares an
:class:`AppSlot` next to that object (``queueing.app_redis``, ``ephemeral.memory_store``).

Infrastructure: imports no domain package at run time; the domain types below are for the type checker only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from flask import Flask, current_app

from backend.config import Settings

if TYPE_CHECKING:
    from backend.chains.registry import ChainRegistry
    from backend.observability.hooks import Observability

T = TypeVar("T")

# The settings stay in app.config under this name (tests swap them there with dataclasses.replace).
SETTINGS_KEY = "PAYINTENT_SETTINGS"


def _app(app: Flask | None) -> Flask:
    return app if app is not None else current_app


class AppSlot(Generic[T]):
    """One typed entry of ``app.extensions``."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._lock = threading.Lock()

    def set(self, app: Flask, value: T) -> T:
        app.extensions[self.key] = value
        return value

    def peek(self, app: Flask | None = None) -> T | None:
        """The value, or None when it was never set on this app."""
        return cast("T | None", _app(app).extensions.get(self.key))

    def get_or_make(self, make: Callable[[], T], app: Flask | None = None) -> T:
        """The value, made by ``make()`` and set the first time. Under a lock: gunicorn's threads share the app, and
        two first requests at once would each make one (two Redis pools, two in-process stores, one lost)."""
        found = self.peek(app)
        if found is not None:
            return found
        with self._lock:
            found = self.peek(app)
            return found if found is not None else self.set(_app(app), make())

    def get(self, app: Flask | None = None) -> T:
        """The value; a KeyError when it was never set (``create_app`` sets every slot below)."""
        return cast(T, _app(app).extensions[self.key])


_CHAINS: AppSlot[ChainRegistry] = AppSlot("payintent.chains")
_OBSERVABILITY: AppSlot[Observability] = AppSlot("payintent.observability")


def init_app(app: Flask, settings: Settings, chains: ChainRegistry) -> None:
    """Bind the settings and the chain registry to ``app`` (``create_app`` does, first)."""
    app.config[SETTINGS_KEY] = settings
    _CHAINS.set(app, chains)


def settings(app: Flask | None = None) -> Settings:
    return cast(Settings, _app(app).config[SETTINGS_KEY])


def chains(app: Flask | None = None) -> ChainRegistry:
    """The networks this app settles on."""
    return _CHAINS.get(app)


def set_observability(app: Flask, value: Observability) -> None:
    _OBSERVABILITY.set(app, value)


def observability(app: Flask | None = None) -> Observability:
    """The app's chain probes and metrics registry (``observability.hooks.init_app`` sets them)."""
    return _OBSERVABILITY.get(app)
