"""`payintent dev` (make run) stops everything it started on SIGTERM, SIGINT and SIGHUP, every time, within
seconds, also in the middle of start-up; a killed one leaves nothing behind; a restart refuses clearly what it
cannot use; and an idle stack keeps its banner on screen.

Each run gets its own var dir and free ports (``--port``, PAYINTENT_DEVNET_PORT_BASE). The signal goes to the
whole process group, as a supervisor, a closed terminal or Ctrl-C sends it; the SIGTERM runs go through
``make`` (which sends its child a second SIGTERM) when make is installed. "Everything it started" is every
process seen below it, and every process whose environment or command line names the run's var dir (Anvil,
the Solana RPC, Redis, gunicorn and its workers, the worker, the relayer), so one that escaped is found too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from devnet import free_port_base
from devnet.anvil import port_is_free
from tests.conftest import free_port

PAYINTENT = str(Path(sys.executable).with_name("payintent"))
STOPPED_WITHIN = 20.0  # seconds from the signal until every process is gone and every port free (a stop takes
# 1-3 s on an idle machine; the margin is for a loaded one: the suite runs under pytest-xdist next to other stacks)
BANNER_END = "Ctrl-C stops everything"
MAKE = shutil.which("make")

# pytest-xdist (--dist loadgroup): these tests run one after another on one worker, as they always did; each
# starts a whole stack, and STOPPED_WITHIN is measured against the clock.
pytestmark = pytest.mark.xdist_group("devstack_stop")


@dataclass
class DevRun:
    """One `payintent dev` in its own session (so its process group can be signalled), and its processes."""

    var_dir: Path
    port: int
    port_base: int
    proc: subprocess.Popen[bytes]
    output: Path
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    _sampling: threading.Event = field(default_factory=threading.Event)

    @property
    def ports(self) -> list[int]:
        return [self.port, *range(self.port_base, self.port_base + 4)]

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def sample(self) -> None:
        """Remember every descendant (processes in their own session included: they are still children). A sampling
        thread may add to ``seen`` while the test reads it: readers take a snapshot (``_seen``)."""
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def start_sampling(self) -> None:
        def loop() -> None:
            while not self._sampling.wait(0.05):
                self.sample()

        threading.Thread(target=loop, daemon=True).start()

    def _seen(self) -> tuple[psutil.Process, ...]:
        return tuple(self.seen.values())  # one C call: no other thread's insert can land in the middle

    def ours(self) -> list[psutil.Process]:
        """Live processes of this run: descendants seen, and any process whose environment or command line
        names our var dir (redis-server rewrites the memory /proc shows as its environment: its socket path)."""
        found = {p.pid: p for p in self._seen()}
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("PAYINTENT_VAR_DIR") == str(self.var_dir) or any(
                    str(self.var_dir) in arg for arg in proc.cmdline()
                ):
                    found.setdefault(proc.pid, proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        alive = []
        for proc in found.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                continue
        return alive

    def wait_until(self, condition: Callable[[], bool], timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"payintent dev exited early:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out; output:\n{self.text()[-3000:]}"
            time.sleep(0.05)

    def wait_serving(self) -> None:
        self.wait_until(lambda: BANNER_END in self.text())

    def has_child(self, needle: str) -> bool:
        self.sample()
        return any(needle in " ".join(_cmdline(p)) for p in self._seen())

    def stop_and_check(self, sig: signal.Signals, *, group: bool = True) -> float:
        """Send ``sig`` (to the process group, or to the `payintent dev` process alone); assert that within
        STOPPED_WITHIN seconds no process of the run is alive and each of its ports is free. Returns the time."""
        self.sample()
        (os.killpg if group else os.kill)(self.proc.pid, sig)
        sent = time.monotonic()
        while time.monotonic() - sent < STOPPED_WITHIN:
            self.sample()
            if self.proc.poll() is not None and not self.ours() and all(port_is_free(p) for p in self.ports):
                break
            time.sleep(0.1)
        took = time.monotonic() - sent
        left = [f"{p.pid}: {' '.join(_cmdline(p))[:120]}" for p in self.ours()]
        taken = [p for p in self.ports if not port_is_free(p)]
        self._sampling.set()
        for proc in self.ours():  # leave nothing for the next test, whatever happened
            proc.kill()
        assert not left and not taken and self.proc.poll() is not None, (
            f"{sig.name}: after {took:.1f}s still alive: {left}; ports taken: {taken}; "
            f"payintent dev exit: {self.proc.poll()}\n{self.text()[-2500:]}"
        )
        return took


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _dev_env(var_dir: Path, port_base: int) -> dict[str, str]:
    unset = ("DATABASE_URL", "REDIS_URL", "CHECKOUT_HOST", "CHAINS_FILE", "LOG_LEVEL", "PAYINTENT_DEV_PORT")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return env | {"PAYINTENT_VAR_DIR": str(var_dir), "PAYINTENT_DEVNET_PORT_BASE": str(port_base)}


def start_dev(tmp_path: Path, *, via_make: bool = False, name: str = "run", port_base: int | None = None) -> DevRun:
    var_dir = tmp_path / name / "var"
    var_dir.mkdir(parents=True, exist_ok=True)
    port, port_base = free_port(), port_base or free_port_base()
    argv = [PAYINTENT, "dev", "--port", str(port)]
    if via_make and MAKE:
        makefile = tmp_path / name / "Makefile"
        makefile.write_text(f"run:\n\t{' '.join(argv)}\n")  # like the project's `make run`
        argv = [MAKE, "-s", "-f", str(makefile), "run"]
    output = tmp_path / name / "output"
    with output.open("w") as out:
        proc = subprocess.Popen(
            argv, env=_dev_env(var_dir, port_base), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    run = DevRun(var_dir, port, port_base, proc, output)
    run.start_sampling()
    return run


@pytest.fixture
def runs() -> Iterator[list[DevRun]]:
    started: list[DevRun] = []
    yield started
    for run in started:  # a failed assertion mid-way leaves nothing running
        run._sampling.set()
        for proc in run.ours():
            proc.kill()
        if run.proc.poll() is None:
            run.proc.kill()


REPEATS = 3  # the issue saw leftovers in 3 of 5 tries: three runs of each case catch such a race


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_to_the_group_stops_everything_while_serving(
    sig: signal.Signals, tmp_path: Path, runs: list[DevRun]
) -> None:
    for i in range(REPEATS):
        run = start_dev(tmp_path, via_make=sig == signal.SIGTERM, name=f"run{i}")
        runs.append(run)
        run.wait_serving()
        assert run.has_child("anvil") and run.has_child("redis-server") and run.has_child("relayer")
        run.stop_and_check(sig)
        assert f"{sig.name}: stopping" in run.text() and "payintent: stopped" in run.text()


# Moments of start-up: while the devnet deploys its contracts, while the api, worker and relayer start,
# and a random moment early on.
MOMENTS: dict[str, Callable[[DevRun], bool]] = {
    "deploying": lambda run: run.has_child("devnet.solana_rpc"),
    "starting-apps": lambda run: run.has_child(" worker"),
}


def test_a_stop_signal_during_start_up_stops_what_has_started(tmp_path: Path, runs: list[DevRun]) -> None:
    rng = random.Random()
    for i, moment in enumerate([*MOMENTS, "random"]):
        run = start_dev(tmp_path, via_make=True, name=f"run{i}")
        runs.append(run)
        if moment == "random":
            pause = rng.uniform(0.3, 3.0)
            started = time.monotonic()
            run.wait_until(lambda: time.monotonic() - started > pause)  # noqa: B023 - used at once
        else:
            run.wait_until(lambda: MOMENTS[moment](run), timeout=180)  # noqa: B023 - used at once
        run.stop_and_check(signal.SIGTERM)


def test_a_killed_payintent_dev_leaves_nothing_running(tmp_path: Path, runs: list[DevRun]) -> None:
    """SIGKILL to `payintent dev` alone (no clean-up can run): its children end with it (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    run = start_dev(tmp_path)
    runs.append(run)
    run.wait_serving()
    run.stop_and_check(signal.SIGKILL, group=False)


def test_idle_stack_keeps_its_banner_on_screen_and_a_second_start_is_refused_clearly(
    tmp_path: Path, runs: list[DevRun]
) -> None:
    """Idle for 30 s after the banner: no more than a handful of lines (RQ's per-job lines printed about 80
    per 30 s). Meanwhile, starts that cannot work are refused with the port and what holds it."""
    run = start_dev(tmp_path)
    runs.append(run)
    run.wait_serving()
    printed_before = len(run.text())

    # The same var dir: refused (it would share the Redis socket, database and devnet).
    env = _dev_env(run.var_dir, free_port_base())
    again = subprocess.run([PAYINTENT, "dev", "--port", str(free_port())], env=env, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert again.returncode == 1 and f"another `payintent dev` (pid {run.proc.pid})" in again.stderr, again.stderr
    # Another var dir, but the API's port is taken: refused, naming what holds it.
    other = tmp_path / "other" / "var"
    taken_api = subprocess.run([PAYINTENT, "dev", "--port", str(run.port)], env=_dev_env(other, free_port_base()),
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert taken_api.returncode == 1, taken_api.stderr
    assert f"port {run.port} (pid " in taken_api.stderr and "gunicorn" in taken_api.stderr
    assert "--port" in taken_api.stderr  # and what to do
    # ... or the devnet's: refused, naming the Anvil that holds it and how to stop such a one.
    taken_chain = subprocess.run([PAYINTENT, "dev", "--port", str(free_port())], env=_dev_env(other, run.port_base),
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
    assert taken_chain.returncode == 1, taken_chain.stderr
    assert f"port {run.port_base} (pid " in taken_chain.stderr and "anvil" in taken_chain.stderr
    assert "payintent devnet down" in taken_chain.stderr
    assert not list(other.glob("devnet/state.json"))
    # The refused starts left the running stack alone.
    assert run.proc.poll() is None and run.has_child("anvil")

    time.sleep(30)  # idle: the worker runs its periodic jobs all along
    idle_lines = run.text()[printed_before:].splitlines()
    assert len(idle_lines) <= 4, idle_lines  # under 10 a minute
    run.stop_and_check(signal.SIGINT)


def test_a_devnet_left_by_a_killed_payintent_dev_is_replaced_not_reused(tmp_path: Path, runs: list[DevRun]) -> None:
    """Where PR_SET_PDEATHSIG does not exist, a killed `payintent dev` leaves its devnet running; the next
    one must not reuse chains whose state no longer matches var/ (nor fail on their ports): it stops them, says
    so, and starts afresh. Simulated here with a devnet from `devnet up` marked as owned by a dead process."""
    var_dir = tmp_path / "run" / "var"
    port_base = free_port_base()
    env = _dev_env(var_dir, port_base)
    up = subprocess.run([PAYINTENT, "devnet", "up"], env=env, capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    state_file = var_dir / "devnet" / "state.json"
    state = json.loads(state_file.read_text())
    old_pids = [c["pid"] for c in state["networks"].values()] + [state["solana"]["pid"]]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    state["owner"] = {"pid": int(gone.stdout), "create_time": 1.0, "command": "payintent dev"}
    state_file.write_text(json.dumps(state))
    try:
        run = start_dev(tmp_path, port_base=port_base)  # the same var dir and ports
        runs.append(run)
        run.wait_serving()
        assert f"stopped the devnet an earlier `payintent dev` (pid {int(gone.stdout)}) left running" in run.text()
        assert not any(psutil.pid_exists(pid) and "anvil" in " ".join(_cmdline(psutil.Process(pid)))
                       for pid in old_pids[:3])  # fmt: skip
        assert "was already running" not in run.text()  # not reused
        assert json.loads(state_file.read_text())["owner"]["pid"] == run.proc.pid
        run.stop_and_check(signal.SIGTERM)
    finally:
        subprocess.run([PAYINTENT, "devnet", "down"], env=env, capture_output=True, timeout=60)
