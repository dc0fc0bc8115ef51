"""The local profile's MLflow tracking server, started on demand like the local Ray cluster.

:func:`ensure_server` returns the tracking URI to log to: ``$MLFLOW_TRACKING_URI`` when configured (a team's
server), else the server this module started before (its state file, while its process lives and answers), else it
starts ``mlflow server`` on 127.0.0.1 at a free port in a session of its own, with a SQLite backend store and a
local artifact directory under ``DIR`` (``$PIPELINE_MLFLOW_DIR``, else ``mlflow`` under the pipeline's home,
:func:`pipeline_steps.settings.home`). The server proxies artifacts (``--serve-artifacts``), so clients never need the
directory, and serves MLflow's web UI at the same URI (a run's page: :func:`pipeline_steps.tracking_run.url`).
:func:`shutdown_server` stops exactly that server.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline_steps import settings
from pipeline_steps.local.ray_cluster import _free_port
from pipeline_steps.local.sessions import pid_alive, stop_session
from pipeline_steps.tracking_run import responds

log = logging.getLogger(__name__)

ENV = "MLFLOW_TRACKING_URI"
STATE_FILE = "pipeline_mlflow_server.json"


def server_dir(directory=None) -> Path:
    if directory:
        return Path(directory)
    from pipeline_steps import settings

    return settings.get_path(settings.MLFLOW_DIR, settings.home() / "mlflow")


def _read_state(d: Path) -> dict | None:
    try:
        return json.loads((d / STATE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def ensure_server(directory=None, *, port: int | None = None, timeout: float = 120) -> str:
    """The tracking URI to use (``http://127.0.0.1:PORT`` for a started server), starting one if needed."""
    configured = os.environ.get(ENV)
    if configured and not directory:
        return configured
    d = server_dir(directory).resolve()
    state = _read_state(d)
    if state and pid_alive(state["pid"]) and responds(state["uri"]):
        return state["uri"]
    (d / "artifacts").mkdir(parents=True, exist_ok=True)
    port = int(port or settings.get(settings.MLFLOW_PORT) or _free_port())
    uri = f"http://127.0.0.1:{port}"
    mlflow_exe = Path(sys.executable).with_name("mlflow")
    cmd = [
        str(mlflow_exe) if mlflow_exe.exists() else "mlflow",
        "server",
        f"--backend-store-uri=sqlite:///{d / 'mlflow.db'}",
        f"--artifacts-destination={d / 'artifacts'}",
        "--host=127.0.0.1",
        f"--port={port}",
        "--workers=1",  # the local machine has few cores; one process serves a few runs easily
    ]
    # MLflow 3 would also spawn job-queue consumers (huey processes, for its GenAI jobs); tracking and the UI need none
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    env.pop(ENV, None)
    log_path = d / "server.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    (d / STATE_FILE).write_text(json.dumps({"pid": proc.pid, "pgid": proc.pid, "uri": uri, "log": str(log_path)}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            (d / STATE_FILE).unlink(missing_ok=True)
            tail = log_path.read_text(errors="replace").strip().splitlines()
            last = tail[-1] if tail else ""
            raise RuntimeError(f"mlflow server exited with {proc.returncode}: {last} (see {log_path})")
        if responds(uri):
            log.info("started a local MLflow tracking server at %s (pid %d, store %s)", uri, proc.pid, d)
            return uri
        time.sleep(0.5)
    shutdown_server(d)
    raise TimeoutError(f"the local MLflow server did not answer at {uri} within {timeout:.0f}s (see {log_path})")


def shutdown_server(directory=None, timeout: float = 20) -> bool:
    """Stop the server :func:`ensure_server` started in ``directory``; False if it started none."""
    d = server_dir(directory).resolve()
    state = _read_state(d)
    if not state:
        return False
    pid, sid = int(state["pid"]), int(state["pgid"])
    stop_session(pid, sid, timeout, poll=0.2)
    (d / STATE_FILE).unlink(missing_ok=True)
    log.info("stopped the local MLflow server at %s", state["uri"])
    return True
