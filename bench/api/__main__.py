"""python -m bench.api: see bench/api/__init__.py."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys

import bench.api
from bench._common import DOC, ROOT, Session, argument_parser, stop_on_signals, wait_for_quiet, write_section
from bench.api.measure import LoadSettings, wrk_path
from bench.api.report import SECTION, aims, section, table
from bench.api.scenarios import Run
from bench.api.stack import ENGINES, Gunicorn, database


def parse_args(argv: list[str]) -> argparse.Namespace:
    cores = os.cpu_count() or 1
    parser = argument_parser(bench.api.__doc__ or "", SECTION)
    parser.prog = "python -m bench.api"
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: sqlite,postgresql")
    parser.add_argument("--pg-url", default=None, help="use this PostgreSQL server (a private database is made)")
    parser.add_argument("--workers", type=int, default=2 * cores, help="gunicorn workers (default: 2 x nproc)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections")
    parser.add_argument("--duration", type=int, default=10, help="seconds measured per cell")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of unmeasured load before each cell")
    parser.add_argument("--seed", type=int, default=200, help="intents created before the cells")
    parser.add_argument(
        "--app", default="backend.app:create_app()", help="gunicorn app of the API (to try a variant of it)"
    )
    parser.add_argument("--retries", type=int, default=2, help="re-measure a cell disturbed by other processes")
    parser.add_argument("--wait-idle", type=float, default=120, help="seconds to wait for an idle machine first")
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engine(s) {sorted(unknown)}; known: {', '.join(ENGINES)}")
    if args.seed < 1:
        parser.error("--seed must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    wrk_path()
    stop_on_signals()
    started = dt.datetime.now(dt.UTC)
    load = LoadSettings(args.threads, args.connections, args.duration, args.warmup)
    session = Session("api")
    run = Run(
        load, Gunicorn(args.workers), args.seed, session.workdir, session.procs, app=args.app, retries=args.retries
    )
    print(
        f"gunicorn {run.gunicorn.describe()}; wrk -t{load.threads} -c{load.connections} "
        f"{load.warmup}s warm-up + {load.duration}s per cell",
        flush=True,
    )
    with session:  # stops every server and removes the workdir however the run ends
        run.quiet_before = wait_for_quiet(args.wait_idle)
        run.run_bare()
        for engine in args.engines:
            with database(engine, args.pg_url, session.workdir) as db:
                run.run_engine(db)
        run.run_bare()
    if session.exit_code is not None:
        return session.exit_code

    print()
    print(table(run.cells))
    print()
    for line in aims(run.cells):
        print(line)
    broken = [c for c in run.cells if c.error_count]
    for c in broken:
        print(f"errors in {c.server} {c.endpoint}: {c.errors}", file=sys.stderr)
    if args.write:
        write_section(section(run, started, argv), SECTION)
        print(f"\nwrote the section '{SECTION}' of {DOC.relative_to(ROOT)}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
