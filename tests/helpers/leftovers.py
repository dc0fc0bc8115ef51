"""The end-of-run check that no process the tests started is still alive (a pytest plugin; conftest registers it).

A process is the run's when it descends from the pytest process, or carries the run's ``PIPELINE_TEST_RUN`` in its
environment. Either alone misses some: Airflow, Ray and PostgreSQL retitle their processes (setproctitle), which
overwrites ``/proc/PID/environ``; and a daemon (``ray start``, ``pg_ctl start``) leaves its parent's tree, unless
pytest is its subreaper: with ``PR_SET_CHILD_SUBREAPER`` an orphan below pytest becomes pytest's child, not init's.
Under pytest-xdist the controller's only children of its own are the workers, so a thread there reaps the orphans
that exit (their zombies would otherwise hold a pid each until the end). One still alive ``GRACE_S`` after the run
ends fails it, with its command line, and is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.listening import descendants

# inherited by xdist workers and by every process a test starts
TEST_RUN = os.environ.setdefault("PIPELINE_TEST_RUN", uuid.uuid4().hex)
GRACE_S = float(os.environ.get("PIPELINE_TEST_LEFTOVER_GRACE_S", "30"))  # Ray and Airflow take seconds to exit
PR_SET_CHILD_SUBREAPER = 36
XDIST_WORKER = b"import sys;exec(eval(sys.stdin.readline()))"  # execnet's bootstrap: how a worker's command line reads
# multiprocessing's helpers of pytest's own process (a test in it used multiprocessing): they exit when pytest does
OWN_HELPERS = (b"from multiprocessing.resource_tracker import main", b"from multiprocessing.forkserver import main")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid), or None for a process gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _is_worker(pid: int) -> bool:
    return XDIST_WORKER in _cmdline(pid)


def _is_ours(pid: int) -> bool:
    """An xdist worker, or a multiprocessing helper of pytest's own process."""
    cmd = _cmdline(pid)
    return XDIST_WORKER in cmd or any(h in cmd for h in OWN_HELPERS)


def leftovers() -> list[tuple[int, str]]:
    """Live processes of this run (below pytest, or carrying the run's marker) other than pytest itself and its
    xdist workers: (pid, command line)."""
    me, token = os.getpid(), f"PIPELINE_TEST_RUN={TEST_RUN}".encode()
    pids, marked = descendants(me), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token in (entry / "environ").read_bytes().split(b"\0"):
                    marked.add(int(entry.name))
            except OSError:
                continue
    found = []
    for pid in sorted((pids | marked) - {me}):
        stat = _stat(pid)
        if stat is None or stat[0] == "Z" or (stat[1] == me and _is_ours(pid)):
            continue
        cmd = _cmdline(pid).replace(b"\0", b" ").decode(errors="replace").strip()
        found.append((pid, cmd[:160] or "(no command line)"))
    return found


def _reap_orphans(stop: threading.Event) -> None:
    me, workers = os.getpid(), set()
    while not stop.wait(1):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid, stat = int(entry.name), _stat(int(entry.name))
            if stat is None or stat[1] != me or pid in workers:
                continue
            if stat[0] != "Z":
                if _is_worker(pid):
                    workers.add(pid)  # xdist's own: execnet waits for it
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller watches the whole run
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        config._leftover_note = f"not a subreaper (errno {ctypes.get_errno()}): daemons are found by environment only"
    if config.getoption("numprocesses", None):
        stop = threading.Event()
        threading.Thread(target=_reap_orphans, args=(stop,), name="reap-orphans", daemon=True).start()
        config._leftover_reaper = stop


@pytest.hookimpl(trylast=True)  # after xdist has stopped its workers
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):
        return
    deadline = time.monotonic() + GRACE_S
    left = leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = leftovers()
    if hasattr(config, "_leftover_reaper"):
        config._leftover_reaper.set()
    if hasattr(config, "_leftover_note"):
        sys.stderr.write(f"\nleftover check: {config._leftover_note}\n")
    if not left:
        return
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    lines = "\n".join(f"  {pid}: {cmd}" for pid, cmd in left)
    sys.stderr.write(
        f"\n{len(left)} process(es) started by the tests were still alive {GRACE_S:.0f} s after the run (killed):\n"
        f"{lines}\n"
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
