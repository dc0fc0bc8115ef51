"""Background services of the local profile (the Ray cluster, the MLflow server), each started in a session of its
own (``start_new_session=True``: the session id is the leader's pid), and stopped whole.

A process group is not enough: Ray puts each worker (``ray::IDLE``, ``ray::JobSupervisor``) in a process group of its
own inside the session, so signalling the leader's group left them running after the cluster was gone (found by the
test suite's leftover check); and a Ray job's driver starts a session of its own below its supervisor. So a service
is every process of its session and every process below one of them.
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from pipeline_steps import atomic


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs: :func:`pipeline_steps.atomic.pid_alive`, but a zombie counts as gone (and is reaped
    when it is our child)."""
    if not atomic.pid_alive(pid):
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:  # not our child: alive unless a zombie
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:  # another user's: alive
            return True


def members(sid: int) -> dict[int, psutil.Process]:
    """Every live process of session ``sid`` and every process below one of them."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
        except (OSError, psutil.Error):  # gone meanwhile
            continue
    return found


def _running(procs: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    out = {}
    for pid, proc in procs.items():
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out[pid] = proc
        except psutil.Error:
            continue
    return out


def _signal(procs: dict[int, psutil.Process], sig: int) -> None:
    for proc in procs.values():
        try:
            proc.send_signal(sig)  # psutil checks the pid was not reused by another process
        except psutil.Error:
            continue


def stop_session(pid: int, sid: int, timeout: float, poll: float = 0.5, grace: float | None = None) -> None:
    """Stop the service led by ``pid`` in session ``sid``: SIGTERM to all of it; once the leader has exited, or the
    rest has and only the leader lingers (``ray start`` drains for 30 s after its node is gone), or after ``grace``
    (half of ``timeout`` by default), SIGKILL to what is left; then wait up to half of ``timeout`` for it to be gone."""
    procs = members(sid)
    _signal(procs, signal.SIGTERM)
    deadline = time.monotonic() + (timeout / 2 if grace is None else grace)
    while time.monotonic() < deadline and pid_alive(pid):
        if not set(_running(procs)) - {pid}:
            break
        time.sleep(poll)
    procs.update(members(sid))  # anything started meanwhile
    _signal(_running(procs), signal.SIGKILL)
    deadline = time.monotonic() + timeout / 2
    while _running(procs) and time.monotonic() < deadline:
        pid_alive(pid)  # reaps the leader when it is our child
        time.sleep(poll)
