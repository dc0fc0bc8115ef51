"""`make airflow`: Airflow on the local profile, UI and all, for clicking through the trigger form.

The same embedded default as `make demo` (offline Hugging Face cache from the shipped fixtures, the local file://
store, the tiny model, the `gpu` pool, a local Ray cluster on free ports), then Airflow's four components (what
`airflow standalone` starts, but restarted when one exits: scripts/airflow_components.py) with the UI on a free port
it prints. Local use only: every UI user is an admin without a login
(``AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS``), so the API server listens on the loopback address only
(``PIPELINE_AIRFLOW_HOST`` to change it: then configure a real auth manager first). Ctrl-C, SIGTERM or SIGHUP stops
Airflow, the MLflow server and the Ray cluster it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline_steps import settings
from scripts.local_profile import ROOT, _free_port, prepare, stop_services

# a cold start (database migration, four components, the first parse) takes about a minute alone and over five
# minutes on a two-core machine shared with another test suite
START_TIMEOUT_S = 600


def airflow_env(home: Path, airflow_home: Path, port: int) -> dict[str, str]:
    env = prepare(home, airflow_home)
    env.update(
        {
            "AIRFLOW__API__PORT": str(port),
            # Airflow's default is every interface; with every user an admin, only this machine may connect
            "AIRFLOW__API__HOST": settings.get(settings.AIRFLOW_HOST),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",  # local only: no login
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        }
    )
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


def api(url: str, path: str, method: str = "GET", body: dict | None = None, timeout: float = 60):
    """One call to Airflow's REST API (``/api/v2``; no login on the local profile): JSON in, JSON out."""
    req = urllib.request.Request(
        f"{url}/api/v2{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


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
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_server.ensure_server(home / "mlflow")
        proc, url = start(home, airflow_home, port, log_path)
    except Stop as sig:
        print(f"{sig}: stopping ...", flush=True)
        stop_services(home)
        return 0
    except BaseException:
        stop_services(home)
        raise
    print(
        f"\nAirflow UI: {url}  (no login: local use only)\n"
        f"MLflow UI: {os.environ['MLFLOW_TRACKING_URI']}  (tracking server, store {home / 'mlflow'})\n"
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
