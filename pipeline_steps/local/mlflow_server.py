"""The local profile's MLflow tracking server, started on demand like the local Ray cluster.

:func:`ensure_server` returns the tracking URI to log to: ``$MLFLOW_TRACKING_URI`` when configured (a team's
server), else the server this module started before (its state file, while its process lives and answers), else it
starts ``mlflow server`` on 127.0.0.1 at a free port in a session of its own, with a SQLite backend store and a
local artifact directory under ``DIR`` (``$PIPELINE_MLFLOW_DIR``, else ``mlflow`` under the pipeline's home,
:func:`pipeline_steps.settings.home`). The server proxies artifacts (``--serve-artifacts``), so clients never need the
directory, and serves MLflow's web UI at the same URI (a run's page: :func:`pipeline_steps.tracking_run.url`).
:func:`shutdown_server` stops exactly that server.

The server is MLflow's own basic-auth app (``--app-name basic-auth``): every request but ``/health`` and the static
files needs the user ``admin`` and a password generated once per directory, kept with the user database in ``DIR``
(``credentials.json``, ``basic_auth.db``, both mode 0600; the directory 0700) and never logged. The pipeline's own
clients get them from :func:`client_env` (``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, MLflow's client
reads them) or, for a local Ray job, the file itself (:func:`credentials_file`, the format of
``$PIPELINE_MLFLOW_CREDENTIALS_FILE``); a browser asks for them. ``--allowed-hosts`` lets through only loopback
``Host`` names (localhost, 127.0.0.1, [::1], any port; MLflow's default also admits private addresses), so a page
that rebinds its DNS name to 127.0.0.1 is refused.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from pipeline_steps import library_env, settings
from pipeline_steps.local.ray_cluster import _free_port
from pipeline_steps.local.sessions import pid_alive, stop_session
from pipeline_steps.tracking_run import responds

log = logging.getLogger(__name__)

STATE_FILE = "pipeline_mlflow_server.json"
CREDENTIALS_FILE = "credentials.json"  # {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": ...}
AUTH_CONFIG, AUTH_DB = "basic_auth.ini", "basic_auth.db"
ADMIN = "admin"
FLASK_KEY = "flask_secret_key"
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
# loopback names only, with and without a port ("[[]" is fnmatch's literal "[")
ALLOWED_HOSTS = "localhost,localhost:*,127.0.0.1,127.0.0.1:*,[::1],[[]::1]:*"


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


def credentials_file(directory=None) -> Path:
    """The file holding the server's admin credentials (mode 0600), created with a new password if missing."""
    d = server_dir(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # the auth database and the credentials are this user's alone
    path = d / CREDENTIALS_FILE
    if not path.exists():
        tmp = d / f".{CREDENTIALS_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            # the Flask secret key signs the auth app's CSRF tokens (MLflow wants one fixed per server)
            json.dump(
                {USERNAME_ENV: ADMIN, PASSWORD_ENV: secrets.token_urlsafe(18), FLASK_KEY: secrets.token_hex(32)}, f
            )
        try:
            os.link(tmp, path)  # first writer wins: a concurrent start keeps the same password
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    os.chmod(path, 0o600)
    return path


def client_env(directory=None) -> dict[str, str]:
    """``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD`` of the server in ``directory`` (secret values:
    for a client's own environment, never a job's runtime environment or a log)."""
    data = json.loads(credentials_file(directory).read_text())
    return {USERNAME_ENV: data[USERNAME_ENV], PASSWORD_ENV: data[PASSWORD_ENV]}


def is_local_server(uri: str | None, directory=None) -> bool:
    """True when ``uri`` is the server this module started in ``directory`` (its state file names it)."""
    state = _read_state(server_dir(directory).resolve())
    return bool(uri and state and state.get("uri") == uri.rstrip("/"))


def _auth_config(d: Path) -> Path:
    """MLflow's basic-auth settings for the server in ``d`` (its user database beside the tracking store)."""
    path = d / AUTH_CONFIG
    path.write_text(
        "[mlflow]\n"
        "default_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{d / AUTH_DB}\n"
        f"admin_username = {ADMIN}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    return path


def ensure_server(directory=None, *, port: int | None = None, timeout: float = 120) -> str:
    """The tracking URI to use (``http://127.0.0.1:PORT`` for a started server), starting one if needed."""
    configured = os.environ.get(library_env.MLFLOW_TRACKING_URI)
    if configured and not directory:
        return configured
    d = server_dir(directory).resolve()
    state = _read_state(d)
    if state and pid_alive(state["pid"]) and responds(state["uri"]):
        if state.get("auth"):
            return state["uri"]
        shutdown_server(d)  # started by an earlier release without authentication: replaced by one with it
    (d / "artifacts").mkdir(parents=True, exist_ok=True)
    creds = json.loads(credentials_file(d).read_text())
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
        "--app-name=basic-auth",
        f"--allowed-hosts={ALLOWED_HOSTS}",
        "--workers=1",  # the local machine has few cores; one process serves a few runs easily
    ]
    # MLflow 3 would also spawn job-queue consumers (huey processes, for its GenAI jobs); tracking and the UI need none
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    # the admin's password is read on the first start only (it then lives, hashed, in the user database)
    env.update(
        MLFLOW_AUTH_CONFIG_PATH=str(_auth_config(d)),
        MLFLOW_AUTH_ADMIN_PASSWORD=creds[PASSWORD_ENV],
        MLFLOW_FLASK_SERVER_SECRET_KEY=creds[FLASK_KEY],
    )
    for name in (
        library_env.MLFLOW_TRACKING_URI,
        USERNAME_ENV,
        PASSWORD_ENV,
        "MLFLOW_AUTH_ADMIN_USERNAME",
        "MLFLOW_TRACKING_TOKEN",
    ):
        env.pop(name, None)
    log_path = d / "server.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    state = {"pid": proc.pid, "pgid": proc.pid, "uri": uri, "log": str(log_path), "auth": "basic"}
    (d / STATE_FILE).write_text(json.dumps(state))
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
