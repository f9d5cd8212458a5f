"""What the examples share: they run under the project's virtualenv and read `make run`'s demo.json.

Import it before anything from the project: started with another Python (``python3 examples/...``),
it runs the script again with ``.venv/bin/python`` (``make install`` creates it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_VENV = REPO / ".venv"

if (_VENV / "bin" / "python").exists() and Path(sys.prefix).resolve() != _VENV.resolve():
    os.execv(_VENV / "bin" / "python", [str(_VENV / "bin" / "python"), *sys.argv])


def demo_file() -> Path:
    """``$PAYINTENT_VAR_DIR/demo.json`` (default ``var/demo.json``): written by ``make run``."""
    return Path(os.environ.get("PAYINTENT_VAR_DIR") or REPO / "var") / "demo.json"


def demo_settings(path: Path | None = None) -> dict[str, Any]:
    """The demo merchant, buyers and devnet RPC URLs of the running ``make run`` ({} when absent)."""
    path = path or demo_file()
    return json.loads(path.read_text()) if path.exists() else {}
