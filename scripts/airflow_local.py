"""`make airflow`: Airflow on the local profile, UI and all, for clicking through the trigger form.

The same embedded default as `make demo` (offline Hugging Face cache from the shipped fixtures, the local file://
store, the tiny model, the `gpu` pool, a local Ray cluster on free ports), then Airflow's four components (what
`airflow standalone` starts, but restarted when one exits: scripts/airflow_components.py) with the UI on a free port
it prints. The API server listens on the loopback address only (``PIPELINE_AIRFLOW_HOST`` to change it: then
configure a real auth manager first) and wants a login for everything but its health check: Airflow's simple auth
manager with one user, ``admin``, whose password is generated once per Airflow home and kept in its passwords file
(mode 0600, never logged). `make airflow` prints a link that logs the browser in with one click (the plugin
scripts/airflow_plugins/local_guard.py checks it), and the plugin refuses any request to the loopback port whose
``Host`` is not a loopback name (DNS rebinding). :func:`api` logs in by itself. The MLflow server it starts wants a
login too (user ``admin``, its own generated password, printed; pipeline_steps/local/mlflow_server.py), and its
credentials reach Airflow's tasks through their environment. Ctrl-C, SIGTERM or SIGHUP stops Airflow, the MLflow
server and the Ray cluster it started.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipeline_steps import library_env, settings
from scripts.local_profile import ROOT, _free_port, prepare, stop_services

# a cold start (database migration, four components, the first parse) takes about a minute alone and over five
# minutes on a two-core machine shared with another test suite
START_TIMEOUT_S = 600


USER = "admin"  # the one user of the local profile's Airflow (role admin)
PASSWORDS_FILE = "simple_auth_manager_passwords.json"  # in the Airflow home, mode 0600
PLUGINS = Path(__file__).with_name("airflow_plugins")  # local_guard.py: the Host check and the login link
_HOMES: dict[str, Path] = {}  # UI URL -> Airflow home, for :func:`credentials` (filled by :func:`start`)
_TOKENS: dict[str, str] = {}  # UI URL -> API token


def passwords_file(airflow_home: Path) -> Path:
    return Path(airflow_home) / PASSWORDS_FILE


def ensure_password(airflow_home: Path) -> str:
    """The ``admin`` password of this Airflow home, generated on first use into Airflow's simple auth manager
    passwords file (mode 0600; Airflow would write it world-readable and print it into the component log)."""
    path = passwords_file(airflow_home)
    try:
        password = json.loads(path.read_text()).get(USER)
    except (FileNotFoundError, ValueError, AttributeError):
        password = None
    if not password:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{PASSWORDS_FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        password = secrets.token_urlsafe(18)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({USER: password}) + "\n")
        os.replace(tmp, path)
    os.chmod(path, 0o600)
    return password


def login_url(url: str, password: str) -> str:
    """The link that logs a browser in (scripts/airflow_plugins/local_guard.py) and opens the UI at ``url``."""
    return f"{url}/pipeline/login#{urllib.parse.urlencode({'key': password})}"  # a fragment: in no request, no log


def mlflow_env(home: Path, uri: str | None) -> dict[str, str]:
    """MLflow's client credentials when ``uri`` is the local profile's embedded server (profile ``home``), else {}:
    Airflow's tasks log to it (the export step, the report; a local Ray job inherits them from the worker)."""
    from pipeline_steps.local import mlflow_server

    d = home / "mlflow"
    return mlflow_server.client_env(d) if mlflow_server.is_local_server(uri, d) else {}


def airflow_env(home: Path, airflow_home: Path, port: int) -> dict[str, str]:
    env = prepare(home, airflow_home)
    env.update(
        {
            "AIRFLOW__API__PORT": str(port),
            # Airflow's default is every interface; the local profile's server is for this machine only
            "AIRFLOW__API__HOST": settings.get(settings.AIRFLOW_HOST),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            # a login for every request (issue 46): one admin, its password generated per Airflow home
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords_file(airflow_home)),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        }
    )
    # the Host check and the login link; a test's own plugins folder carries them too (tests/helpers/airflow_plugins)
    env.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(PLUGINS))
    env.update(mlflow_env(home, env.get(library_env.MLFLOW_TRACKING_URI)))
    ensure_password(airflow_home)
    return env


def start(home: Path, airflow_home: Path, port: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start Airflow's components under their supervisor; return its process and the UI URL once the UI answers."""
    env = airflow_env(home, airflow_home, port)
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("airflow_components.py"))],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    _HOMES[url] = Path(airflow_home)
    _TOKENS.pop(url, None)
    deadline = time.time() + START_TIMEOUT_S
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"Airflow's supervisor exited {proc.returncode}; see {log_path}")
            try:
                urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=2)
                return proc, url
            except OSError:
                time.sleep(2)
    except BaseException:  # a signal while waiting: stop what was started
        stop(proc, home)
        raise
    stop(proc, home)
    raise RuntimeError(f"the Airflow UI did not answer at {url} within {START_TIMEOUT_S // 60} minutes; see {log_path}")


def credentials(url: str, airflow_home: Path | None = None) -> tuple[str, str]:
    """(user, password) of the Airflow at ``url``, started by :func:`start` in this process or in ``airflow_home``."""
    home = airflow_home or _HOMES.get(url)
    if home is None:
        raise LookupError(f"no Airflow home known for {url}: pass airflow_home")
    return USER, ensure_password(home)


def token(url: str, airflow_home: Path | None = None, *, fresh: bool = False, timeout: float = 60) -> str:
    """An API token for the Airflow at ``url`` (``POST /auth/token`` with its admin password), cached per URL."""
    if fresh or url not in _TOKENS:
        user, password = credentials(url, airflow_home)
        req = urllib.request.Request(
            f"{url}/auth/token",
            method="POST",
            data=json.dumps({"username": user, "password": password}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            _TOKENS[url] = json.loads(r.read())["access_token"]
    return _TOKENS[url]


def api(url: str, path: str, method: str = "GET", body: dict | None = None, timeout: float = 60):
    """One call to Airflow's REST API (``/api/v2``), logged in as the local profile's admin: JSON in, JSON out."""
    for attempt in (0, 1):
        req = urllib.request.Request(
            f"{url}/api/v2{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={
                "Content-Type": "application/json",
                "Accept": "application/json",
                "Authorization": f"Bearer {token(url, fresh=bool(attempt), timeout=timeout)}",
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 401 or attempt:  # 401: the token expired; log in again once
                raise


def stop(proc: subprocess.Popen, home: Path) -> None:
    """Stop Airflow's components, then the local Ray cluster and MLflow server of profile ``home``."""
    stop_components(proc)
    stop_services(home)


def stop_components(proc: subprocess.Popen) -> None:
    """Stop the supervisor started by :func:`start` and every process left in its group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:  # anything still in the group once the supervisor is gone is an orphan of a component
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Stop(BaseException):
    """Raised by the signal handler: SIGTERM, SIGINT or SIGHUP."""


def _on_signal(signum, _frame):
    raise Stop(signal.Signals(signum).name)


def main() -> int:
    # a container stop (SIGTERM), Ctrl-C (SIGINT) and a closed terminal (SIGHUP) all stop everything started here
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    home = settings.home()
    airflow_home = Path(os.environ.get("AIRFLOW_HOME") or ROOT / ".airflow")
    port = settings.get_int(settings.AIRFLOW_PORT) or _free_port()
    log_path = home / "standalone.log"
    home.mkdir(parents=True, exist_ok=True)
    print(f"starting Airflow on the local profile (AIRFLOW_HOME={airflow_home}, log {log_path}) ...", flush=True)
    from pipeline_steps.local import mlflow_server

    try:
        # started before Airflow so its tasks inherit MLFLOW_TRACKING_URI (the operator would start it on demand too)
        os.environ[library_env.MLFLOW_TRACKING_URI] = mlflow_server.ensure_server(home / "mlflow")
        proc, url = start(home, airflow_home, port, log_path)
    except Stop as sig:
        print(f"{sig}: stopping ...", flush=True)
        stop_services(home)
        return 0
    except BaseException:
        stop_services(home)
        raise
    password = ensure_password(airflow_home)
    mlflow_login = mlflow_env(home, os.environ[library_env.MLFLOW_TRACKING_URI])
    mlflow_user = (
        f"user {mlflow_login['MLFLOW_TRACKING_USERNAME']}, password {mlflow_login['MLFLOW_TRACKING_PASSWORD']}"
        if mlflow_login
        else "its own login"
    )
    print(
        f"\nAirflow UI: {url}\n"
        f"  open this link to log in (one click; keep it to yourself): {login_url(url, password)}\n"
        f"  or log in as user {USER}, password {password} (kept in {passwords_file(airflow_home)}, mode 0600)\n"
        f"MLflow UI: {os.environ['MLFLOW_TRACKING_URI']}  ({mlflow_user}; store {home / 'mlflow'})\n"
        f"DAGs: verl_grpo_pipeline (Trigger opens the form), verl_evaluate_model\n"
        f"store: {home / 'store'}\nCtrl-C (or SIGTERM, SIGHUP) stops Airflow, MLflow and the local Ray cluster.\n",
        flush=True,
    )
    try:
        proc.wait()
    except Stop as sig:
        print(f"{sig}: stopping ...", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        stop(proc, home)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
