"""The baseline for bench/api.py: a bare Flask app whose only endpoint returns ``{"ok": true}``.

Served by gunicorn with exactly the flags the API gets (``bare_app:create_app()``), so the
API's numbers can be read as a fraction of what Flask + gunicorn can do on this machine.
"""

from __future__ import annotations

from typing import Any

from flask import Flask, jsonify


def create_app() -> Flask:
    app = Flask(__name__)

    @app.get("/bare")
    def bare() -> Any:
        return jsonify({"ok": True})

    return app
