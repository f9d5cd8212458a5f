"""backend's units import one another without a cycle (tools/import_graph.py; `make lint` checks the layers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOL = Path(__file__).resolve().parent.parent / "tools" / "import_graph.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", module)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_among_backend_units() -> None:
    tool = _tool()
    graph: dict[str, set[str]] = {}
    for imp in tool.collect():
        graph.setdefault(imp.source, set()).add(imp.target)
    assert tool.strongly_connected(graph) == []


def test_the_tool_finds_a_cycle() -> None:
    tool = _tool()
    graph = {"backend.a": {"backend.b"}, "backend.b": {"backend.c"}, "backend.c": {"backend.a"}, "backend.d": set()}
    assert tool.strongly_connected(graph) == [["backend.a", "backend.b", "backend.c"]]


def test_events_import_no_webhooks() -> None:
    tool = _tool()
    assert not [imp for imp in tool.collect() if imp.source == "backend.events" and imp.target == "backend.webhooks"]
