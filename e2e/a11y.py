"""Accessibility checks with axe-core (from npm, in node_modules/): WCAG 2.1 A and AA rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from playwright.sync_api import Page

AXE = Path(__file__).resolve().parents[1] / "node_modules" / "axe-core" / "axe.min.js"
WCAG_AA = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]


def violations(page: Page) -> list[dict[str, Any]]:
    """axe-core's WCAG 2.1 AA violations on the page as it is now (empty when it passes)."""
    if not page.evaluate("() => typeof window.axe !== 'undefined'"):
        page.evaluate(AXE.read_text())  # evaluated by the browser's debugger: the page's CSP does not apply
    result = page.evaluate("(tags) => axe.run(document, {runOnly: {type: 'tag', values: tags}})", WCAG_AA)
    return [
        {"rule": v["id"], "impact": v["impact"], "help": v["help"], "where": [n["target"] for n in v["nodes"]]}
        for v in result["violations"]
    ]
