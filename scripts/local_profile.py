"""The local profile's Airflow home and its reading, shared by `make demo`, `make airflow` and the tests.

``prepare`` makes a profile home ready (the offline Hugging Face cache from the shipped fixtures, a migrated
Airflow database, the ``gpu`` pool) and returns the environment its components run with; ``local_profile_env`` is
that environment's part for the embedded default (a local Ray cluster on free ports, the local store);
``xcom``/``newest_run``/``task_states`` read a run from the SQLite metadata database.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

from pipeline_steps import library_env, settings

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_temp_dir(home: Path) -> Path:
    """The local Ray cluster's directory, per profile home (short: Ray puts Unix sockets below it)."""
    return Path("/tmp") / f"ray-{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:8]}"


def stop_services(home: Path) -> tuple[bool, bool]:
    """Stop the local Ray cluster and MLflow server that runs on profile ``home`` started on demand; whether each
    was running."""
    from pipeline_steps.local import mlflow_server, ray_cluster

    return bool(ray_cluster.shutdown_cluster(ray_temp_dir(home))), bool(mlflow_server.shutdown_server(home / "mlflow"))


def local_profile_env(home: Path) -> dict[str, str]:
    """Environment for the embedded default; tests use the same function. The local Ray cluster gets free ports
    and its own directory, so it never collides with another cluster on the machine."""
    return {
        settings.RAY_TEMP_DIR: str(ray_temp_dir(home)),
        settings.RAY_PORT: str(_free_port()),
        settings.RAY_DASHBOARD_PORT: str(_free_port()),
        settings.HOME: str(home),
        settings.STORE_URI: f"file://{home / 'store'}",
        library_env.HF_HUB_CACHE: str(home / "hf-cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        # a local job's status is one HTTP call to the local Ray cluster: read it every 5 s, not every 30 s as a
        # cluster's (a smoke run's train, evaluate and export each waited up to 30 s after their job had ended)
        settings.POLL_SECONDS: "5",
    }


def prepare(home: Path, airflow_home: Path) -> dict[str, str]:
    from pipeline_steps.local import offline_hub as local_hub

    env = dict(os.environ, **local_profile_env(home), AIRFLOW_HOME=str(airflow_home))
    env["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), env.get("PATH", "")]
    )  # airflow standalone spawns `airflow ...`
    local_hub.build_cache(local_hub.FIXTURES, home / "hf-cache")
    if not env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN") and not (airflow_home / "airflow.db").exists():
        _database_from_template(env, airflow_home)
    else:
        _migrate(env)
    return env


def _database_from_template(env: dict[str, str], airflow_home: Path) -> None:
    """A new home on SQLite: a copy of an empty database migrated once per Airflow version in the cache
    (:func:`_migrate`'s two commands cost about 6 s of CPU per home; the tests start a dozen homes)."""
    from importlib.metadata import version

    from pipeline_steps.local import build_cache

    def build(d: Path) -> None:
        d.mkdir(parents=True)
        _migrate(dict(env, AIRFLOW_HOME=str(d)))
        (d / "airflow.cfg").unlink(missing_ok=True)  # its generated secrets are no other home's

    entry = settings.cache_dir() / "airflow-db" / version("apache-airflow")
    fallback = airflow_home / ".empty-db"
    template = build_cache.cached_build(
        entry, build, fallback, "Airflow's empty metadata database", lambda d: (d / "airflow.db").is_file()
    )
    airflow_home.mkdir(parents=True, exist_ok=True)
    tmp = airflow_home / f".airflow.db.{os.getpid()}"
    shutil.copyfile(template / "airflow.db", tmp)
    os.replace(tmp, airflow_home / "airflow.db")
    shutil.rmtree(fallback, ignore_errors=True)
    # the home's own airflow.cfg, with its own generated secrets, before any component starts: each component
    # would otherwise generate a JWT secret of its own, and the scheduler's task tokens fail at the API server
    write_config = "from airflow.configuration import write_default_airflow_configuration_if_needed as w; w()"
    subprocess.run([sys.executable, "-c", write_config], env=env, check=True, stdout=subprocess.DEVNULL)


def _migrate(env: dict[str, str]) -> None:
    """Airflow's metadata database migrated to this Airflow, with the ``gpu`` pool."""
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        # --include-deferred: a deferred train task keeps holding its slots while its job runs (Airflow's default
        # frees them, and a second run's train would start on the same GPUs)
        [airflow, "pools", "set", "gpu", "8", "GPUs on the training cluster", "--include-deferred"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def xcom(db: Path, run_id: str, task_id: str, key: str = "return_value") -> list:
    """XCom values of one task of one run, read from the SQLite metadata database."""
    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT value FROM xcom WHERE run_id=? AND task_id=? AND key=? ORDER BY map_index", (run_id, task_id, key)
        ).fetchall()
    out = []
    for (v,) in rows:
        v = json.loads(v) if isinstance(v, (str, bytes)) else v
        out.append(json.loads(v) if isinstance(v, str) else v)
    return out


def newest_run(db: Path, dag_id: str = "verl_grpo_pipeline") -> str | None:
    with sqlite3.connect(db) as c:
        row = c.execute("SELECT run_id FROM dag_run WHERE dag_id=? ORDER BY id DESC LIMIT 1", (dag_id,)).fetchone()
    return row[0] if row else None


def task_states(db: Path, run_id: str) -> dict[str, str]:
    """``{"task[map_index]": state}`` of one run (``[-1]`` for unmapped tasks)."""
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT task_id, map_index, state FROM task_instance WHERE run_id=?", (run_id,)).fetchall()
    return {f"{t}[{m}]": s for t, m, s in rows}
