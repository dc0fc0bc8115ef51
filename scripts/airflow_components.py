"""Airflow's four components for the local profile, each restarted when it exits, as Kubernetes restarts a pod.

``airflow standalone`` starts the same four (scheduler, DAG processor, triggerer, API server) but leaves a component
dead once it exits, and Airflow 3's scheduler does exit on known races (a ``StaleDataError`` on ``dag_run`` when a
backfill is created while it expands mapped tasks, apache/airflow#63926 and its kin): the UI then accepts runs that
never start. Here a dead component is restarted after a short back-off; SIGTERM, SIGINT or SIGHUP stops them all.
As a pod's restart takes the processes of the dead container with it, what a dead component leaves behind (the
LocalExecutor's worker processes of a killed scheduler, the task processes they run) is killed before the restart:
the supervisor is the child subreaper of everything below it, so such orphans become its children and are found
(only those in its own process group: a service a task started in its own session is meant to outlive the task).

Run as ``python -m scripts.airflow_components`` (``scripts/airflow_local.py: start`` does) with the environment
already prepared (``AIRFLOW_HOME``, a migrated database, the executor); each component's lines go to stdout with its
name in front.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

COMPONENTS = ("scheduler", "dag-processor", "triggerer", "api-server")
BACKOFF = (2, 5, 10, 30)  # seconds before the 1st, 2nd, 3rd, later restart of the same component


def _pump(name: str, proc: subprocess.Popen, lock: threading.Lock) -> None:
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"{name:14}| {line.decode('utf-8', 'replace')}")
            sys.stdout.flush()


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init (Linux only; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def kill_orphans(components: set[int]) -> list[int]:
    """SIGKILL the orphans in this process group: children of this process that are not live components (what a
    dead component's process group member left behind), with their descendants. Orphans in a session of their own
    (the local Ray cluster or MLflow server a task started, meant to outlive it) are left alone; any child that
    has exited is reaped."""
    import psutil

    killed, group = [], os.getpgid(0)
    for child in psutil.Process().children():
        if child.pid in components:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE and os.getpgid(child.pid) == group:
                for p in [child, *child.children(recursive=True)]:
                    p.kill()
                    killed.append(p.pid)
            os.waitpid(child.pid, 0 if child.pid in killed else os.WNOHANG)
        except (psutil.NoSuchProcess, ProcessLookupError, ChildProcessError):
            pass
    return killed


def command(airflow: str, name: str) -> list[str]:
    """A component's command line. The scheduler and the triggerer would each serve their task logs on every
    interface (Airflow's log server binds all addresses, with no setting for the host); on one machine the API
    server reads the same log files directly, so no log server is started."""
    return [airflow, name, "--skip-serve-logs"] if name in ("scheduler", "triggerer") else [airflow, name]


def main() -> int:
    airflow = str(Path(sys.executable).with_name("airflow"))
    lock = threading.Lock()
    stopping = threading.Event()
    procs: dict[str, subprocess.Popen] = {}
    restarts = dict.fromkeys(COMPONENTS, 0)

    def say(text: str) -> None:
        with lock:
            print(f"{'supervisor':14}| {text}", flush=True)

    def launch(name: str) -> None:
        proc = subprocess.Popen(command(airflow, name), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=_pump, args=(name, proc, lock), daemon=True).start()
        procs[name] = proc

    def stop(signum, _frame) -> None:
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a container stop, Ctrl-C, a closed terminal
        signal.signal(sig, stop)
    become_subreaper()
    for name in COMPONENTS:
        launch(name)
    say(f"started {', '.join(COMPONENTS)}")
    due: dict[str, float] = {}
    while not stopping.is_set():
        for name, proc in procs.items():
            if proc.poll() is not None and name not in due:
                wait = BACKOFF[min(restarts[name], len(BACKOFF) - 1)]
                say(f"{name} exited with code {proc.returncode}; restarting it in {wait} s")
                due[name] = time.monotonic() + wait
        if orphans := kill_orphans({p.pid for p in procs.values() if p.poll() is None}):
            say(f"killed {len(orphans)} process(es) left behind by an exited component")
        for name, when in list(due.items()):
            if time.monotonic() >= when:
                restarts[name] += 1
                del due[name]
                launch(name)
                say(f"{name} restarted (restart {restarts[name]})")
        stopping.wait(1)
    say("stopping")
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 30
    for proc in procs.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    kill_orphans(set())  # whatever the components left (a worker that outlived its scheduler)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
