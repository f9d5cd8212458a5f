"""What a tool's report says about its run (the benchmarks', the drills'): the commit, the machine, the
package versions, and its section of a doc (docs/benchmarks.md, docs/drills.md) rewritten."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness.env import ROOT

BENCHMARKS_DOC = ROOT / "docs" / "benchmarks.md"


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else ""


def git_commit() -> str:
    """The checkout's commit, and whether tracked files differ from it."""
    commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return commit


def package_version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "?"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """This machine for the Settings: cores, CPU model, operating system."""
    return f"nproc {os.cpu_count()}, {_cpu_model()}, {platform.system()} {platform.release()}"


def write_section(text: str, heading: str, doc: Path = BENCHMARKS_DOC) -> None:
    """Replace one section of the doc (``heading`` up to the next ``## ``), keeping the rest."""
    current = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    lines = current.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    new = text.rstrip("\n") + "\n"
    if start is None:
        head = current.rstrip("\n") + "\n\n" if current.strip() else ""
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(head + new)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    doc.write_text("".join(lines[:start]) + new + ("\n" + tail if tail else ""))


def finish(
    aims_lines: list[str],
    problems: list[str],
    clock_started: float,
    heading: str,
    section: Callable[[], str] | None,
    doc: Path = BENCHMARKS_DOC,
) -> int:
    """The end of a run: the aims, the problems (stderr), the total time, and the doc's section rewritten
    with `section()` (--write; None: not). Returns the exit status: 1 when there were problems."""
    print()
    for line in aims_lines:
        print(line)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    print(f"\ntotal {time.monotonic() - clock_started:.0f} s")
    if section is not None:
        write_section(section(), heading, doc)
        print(f"wrote the section '{heading}' of {doc.relative_to(ROOT)}")
    return 1 if problems else 0
