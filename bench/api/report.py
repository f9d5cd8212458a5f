"""What bench/api reports: the table (the bare baseline as the mean of its runs), the aims, and the Settings
of its section in docs/benchmarks.md."""

from __future__ import annotations

import datetime as dt
import os
import platform

from bench._common import git_commit, machine, package_version
from bench.api.measure import Cell, wrk_version
from bench.api.scenarios import Run
from bench.api.stack import WALLET_NETWORK

SECTION = "## API throughput (bench/api.py)"
AIMS = {"create": 40.0, "get": 65.0}  # % of bare req/s on PostgreSQL


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def bare_cell(cells: list[Cell]) -> Cell:
    """The bare baseline: the mean of its runs."""
    runs = [c for c in cells if c.server == "bare"]
    return Cell(
        server="bare Flask" + (f" (mean of {len(runs)} runs)" if len(runs) > 1 else ""),
        endpoint="bare",
        rps=_mean([c.rps for c in runs]),
        p50_ms=_mean([c.p50_ms for c in runs]),
        p99_ms=_mean([c.p99_ms for c in runs]),
        requests=sum(c.requests for c in runs),
        errors={"all": sum(c.error_count for c in runs)} if any(c.error_count for c in runs) else {},
        cpu_ms={k: _mean([c.cpu_ms.get(k, 0.0) for c in runs]) for k in ("app", "db", "wrk")},
        other_share=max((c.other_share for c in runs), default=0.0),
        attempts=sum(c.attempts for c in runs),
    )


ENDPOINT_NAMES = {
    "bare": "`GET /bare`",
    "get": "`GET /intents/<id>`",
    "list": "`GET /intents?limit=20`",
    "create": "`POST /intents`",
}


def table(cells: list[Cell]) -> str:
    bare = bare_cell(cells)
    rows = [
        "| server | endpoint | req/s | % of bare | p50 ms | p99 ms | errors | CPU ms/req app / db / wrk | other load |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in [bare, *(c for c in cells if c.server != "bare")]:
        cpu = " / ".join("-" if k == "db" and not c.cpu_ms.get(k) else f"{c.cpu_ms.get(k, 0):.2f}" for k in c.cpu_ms)
        rows.append(
            f"| {c.server} | {ENDPOINT_NAMES[c.endpoint]} | {c.rps:.0f} | {100 * c.rps / bare.rps:.0f}% | "
            f"{c.p50_ms:.1f} | {c.p99_ms:.1f} | {c.error_count} | {cpu} | {100 * c.other_share:.0f}% |"
        )
    return "\n".join(rows)


def aims(cells: list[Cell]) -> list[str]:
    bare = bare_cell(cells).rps
    lines = []
    for endpoint, aim in AIMS.items():
        cell = next((c for c in cells if c.server == "postgresql" and c.endpoint == endpoint), None)
        if cell is None:
            continue
        share = 100 * cell.rps / bare
        verdict = "met" if share >= aim else "NOT met"
        lines.append(f"- PostgreSQL {endpoint}: {share:.0f}% of bare (aim >= {aim:.0f}%): {verdict}")
    return lines


def settings_lines(run: Run, started: dt.datetime, argv: list[str]) -> list[str]:
    commit = git_commit()
    bare_runs = ", ".join(f"{c.rps:.0f}" for c in run.cells if c.server == "bare")
    retried = [f"{c.server} {c.endpoint} ({c.attempts})" for c in run.cells if c.attempts > 1]
    load = run.load
    lines = [
        f"- date: {started:%Y-%m-%d %H:%M} UTC; git commit: {commit}",
        f"- machine: {machine()}",
        f"- software: Python {platform.python_version()}, gunicorn {package_version('gunicorn')}, "
        f"Flask {package_version('flask')}, flask-smorest {package_version('flask-smorest')}, "
        f"SQLAlchemy {package_version('sqlalchemy')}, psycopg2 {package_version('psycopg2-binary')}",
        f"- gunicorn, identical for the API (`{run.app}`) and the bare app "
        f"(`bench/bare_app.py`): `{run.gunicorn.describe()}`; sync workers close the connection "
        f"after every response, so each request is a new TCP connection for both",
        f"- workers: {run.gunicorn.workers}"
        + (
            " = 2 x nproc, the default of `payintent serve`; nproc + 1 = 3 was tried too when this setting "
            "was chosen and gave the same req/s within the run-to-run noise (about 5%)"
            if run.gunicorn.workers == 2 * (os.cpu_count() or 1)
            else " (set with --workers; the default is 2 x nproc)"
        ),
        f"- load: wrk {wrk_version()} on the same machine (it shares the {os.cpu_count()} cores), "
        f"{load.threads} threads, {load.connections} connections, {load.warmup} s warm-up then "
        f"{load.duration} s per cell, socket timeout {load.timeout} s; latency is as wrk sees it "
        f"(p50/p99 over all requests of the cell); errors = socket errors + responses >= 400, must be 0",
        f"- bare req/s per run (before and after the API cells): {bare_runs}; the table's bare row is their mean",
        "- CPU ms/req: CPU time of the gunicorn master and workers (app), of the PostgreSQL server's processes "
        "(db; SQLite runs inside the app) and of wrk, divided by the requests of the cell; on 2 cores, "
        "req/s is roughly 2000 / (app + db + wrk + kernel work not charged to a process)",
        f"- other load: the share of the machine's CPU used during the cell by processes not started by the "
        f"benchmark (the machine may be shared); a cell above {100 * run.max_other:.0f}% is measured again "
        f"(up to {run.retries} more times) and the least disturbed attempt is kept; machine busy "
        f"{100 * run.quiet_before:.0f}% just before the run"
        + (f"; re-measured: {', '.join(retried)}" if retried else ""),
    ]
    lines += [f"- {d.engine}: {d.version} ({d.where})" for d in run.databases]
    lines += [
        f"- data: 1 merchant with 1 wallet ({WALLET_NETWORK}), {run.seed} intents created before the cells; "
        f"get cycles over them; list is the newest 20 (and the total); create posts "
        '`{"amount_usdc": 10.5, "order_id": ...}` without Idempotency-Key; cells run get, list, create',
        f"- reproduce: `{' '.join(['.venv/bin/python -m bench.api', *argv])}`",
    ]
    return lines


def section(run: Run, started: dt.datetime, argv: list[str]) -> str:
    parts = [
        SECTION,
        "",
        "Requests per second and latency of the REST API under gunicorn, next to a bare Flask endpoint "
        '(`jsonify({"ok": True})`) served with the same gunicorn flags in the same run. Regenerate with '
        "`.venv/bin/python -m bench.api --write` (it rewrites only this section).",
        "",
        table(run.cells),
        "",
        "Aims (requests/s as a share of bare, PostgreSQL): create >= 40%, get >= 65%.",
        "",
        *aims(run.cells),
        "",
        "Settings:",
        "",
        *settings_lines(run, started, argv),
        "",
    ]
    return "\n".join(parts)
