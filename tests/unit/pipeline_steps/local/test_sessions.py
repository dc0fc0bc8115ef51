"""A local service is stopped whole (pipeline_steps/local/sessions.py), with real processes shaped like a local Ray
cluster: a leader started in a session of its own (as ray_cluster.ensure_cluster starts ``ray start``), a worker that
moves to a process group of its own (as Ray's ``ray::IDLE`` workers do: the old process-group kill left them running),
and a driver below it in a session of its own (as a Ray job's entrypoint), which ignores SIGTERM."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

from pipeline_steps.local import sessions

# the leader: a worker in its own process group, and below it a driver in its own session that ignores SIGTERM
SERVICE = """
import os, signal, subprocess, sys, time
worker = '''
import os, subprocess, sys, time
os.setpgid(0, 0)
driver = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", driver], start_new_session=True)
time.sleep(600)
'''
subprocess.Popen([sys.executable, "-c", worker])
time.sleep(600)
"""


def _started(leader: int, n: int, deadline_s: float = 30) -> dict:
    deadline = time.monotonic() + deadline_s
    while len(found := sessions.members(leader)) < n:
        assert time.monotonic() < deadline, f"the service did not start its {n} processes: {found}"
        time.sleep(0.1)
    return found


def test_stop_session_ends_workers_in_their_own_group_and_drivers_in_their_own_session():
    leader = subprocess.Popen([sys.executable, "-c", SERVICE], start_new_session=True)
    try:
        procs = _started(leader.pid, 3)
        groups = {pid: os.getpgid(pid) for pid in procs}
        assert len(set(groups.values())) == 3, groups  # three process groups: killpg(leader) reaches one of them
        started = time.monotonic()
        sessions.stop_session(leader.pid, leader.pid, timeout=20, poll=0.1)
        assert all(not sessions.pid_alive(pid) for pid in procs), [p for p in procs if sessions.pid_alive(p)]
        # the driver ignores SIGTERM: killed as soon as the leader has exited, not after half of the timeout
        assert time.monotonic() - started < 10
    finally:
        for proc in sessions.members(leader.pid).values():
            with contextlib.suppress(psutil.Error):  # one that ended meanwhile
                proc.kill()
        leader.wait(timeout=10)


def test_stop_session_ends_what_the_leader_left_behind():
    """The leader gone first (killed alone): its session's other processes are still found and stopped."""
    leader = subprocess.Popen([sys.executable, "-c", SERVICE], start_new_session=True)
    procs = _started(leader.pid, 3)
    leader.kill()
    leader.wait(timeout=10)
    left = set(sessions.members(leader.pid))
    assert left and leader.pid not in left
    sessions.stop_session(leader.pid, leader.pid, timeout=20, poll=0.1)
    assert all(not sessions.pid_alive(pid) for pid in procs)
