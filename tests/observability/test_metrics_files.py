"""/metrics in multiprocess mode while a gunicorn worker boots: its metric file exists but is still empty.

prometheus_client's reader fails on such a file (struct.error), which made /metrics answer 500 in CI with three
gthread workers booting; the service's collector leaves empty files out and reads the others."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from backend.observability.metrics import _WorkersCollector


def test_an_empty_worker_file_is_left_out_and_the_others_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # this process writes its samples to files under tmp_path
    try:
        Counter("booting_probe", "a sample written by a live worker", registry=None).inc(3)
        (tmp_path / "counter_999999.db").write_bytes(b"")  # a worker that created its file and has not sized it yet
        with pytest.raises(struct.error):
            list(MultiProcessCollector(None, path=str(tmp_path)).collect())  # the library's own reader
        registry = CollectorRegistry()
        _WorkersCollector(registry, path=str(tmp_path))
        assert b"booting_probe_total 3.0" in generate_latest(registry)
    finally:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
        values.ValueClass = values.get_value_class()
