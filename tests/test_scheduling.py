"""A real Airflow (``airflow standalone``: scheduler with LocalExecutor on SQLite, DAG processor, triggerer, API
server), started and stopped by this module, runs a backfill of ``verl_grpo_pipeline`` over three weekly logical dates
on the local profile in smoke mode. The Hub is replaced by the offline fixture cache whose repositories have dated
revisions (gsm8k: v1 on 2026-09-01, v2 on 2026-10-15), so the runs must record v1, v1, v2; the second run, on an
unchanged revision, must skip preprocessing and upload nothing.
"""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

DATES = ["2026-10-04", "2026-10-11", "2026-10-18"]  # Sundays: @weekly logical dates


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    from scripts.demo import prepare

    tmp = tmp_path_factory.mktemp("airflow-e2e")
    port = free_port()
    saved = dict(os.environ)  # restored at the end: these settings must not leak into later test modules
    os.environ.update(
        {
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "1200",
            "PIPELINE_RAY_TEMP_DIR": tempfile.mkdtemp(
                prefix="ray-", dir="/tmp"
            ),  # Ray's socket paths must stay < 108 bytes
            "PIPELINE_RAY_DASHBOARD_PORT": str(free_port()),
            "PIPELINE_RAY_PORT": str(free_port()),
            # weekly, ending on the backfill's last date: the run that unpausing with catchup off would schedule is the
            # backfill's own last date, so no extra scheduled run competes with the backfill
            "VERL_PIPELINE_SCHEDULE": "@weekly",
            "VERL_PIPELINE_END_DATE": DATES[-1],
        }
    )
    env = prepare(tmp / "pipeline", tmp / "airflow-home")
    airflow_bin = str(Path(sys.executable).with_name("airflow"))
    log = open(tmp / "standalone.log", "w")
    proc = subprocess.Popen(
        [airflow_bin, "standalone"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            out = subprocess.run([airflow_bin, "dags", "list", "-o", "json"], env=env, capture_output=True, text=True)
            if "verl_grpo_pipeline" in out.stdout:
                break
            assert proc.poll() is None, (tmp / "standalone.log").read_text()[-3000:]
            time.sleep(5)
        else:
            pytest.fail("the DAG processor did not register verl_grpo_pipeline within 5 minutes")
        yield {"env": env, "bin": airflow_bin, "home": tmp, "db": tmp / "airflow-home" / "airflow.db"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        from pipeline_steps.local import ray_cluster as local_ray

        local_ray.shutdown_cluster(os.environ["PIPELINE_RAY_TEMP_DIR"])
        os.environ.clear()
        os.environ.update(saved)


def cli_json(stdout: str) -> list:
    """The JSON document in an airflow CLI's stdout (warnings may be printed before it)."""
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("[{", "[]")):
            return json.loads("\n".join(lines[i:]))
    return []


def xcoms(db: Path, run_id: str, task_id: str) -> list:
    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT value FROM xcom WHERE run_id=? AND task_id=? AND key='return_value' ORDER BY map_index",
            (run_id, task_id),
        ).fetchall()
    out = []
    for (v,) in rows:
        v = json.loads(v) if isinstance(v, (str, bytes)) else v
        out.append(json.loads(v) if isinstance(v, str) else v)
    return out


def test_backfill_trains_on_the_dataset_versions_of_each_date(airflow):
    env, airflow_bin = airflow["env"], airflow["bin"]
    conf = {"smoke": True, "experiment": "local_tiny", "backend": "local", "datasets": ["gsm8k"]}
    for attempt in range(3):
        created = subprocess.run(
            [
                airflow_bin,
                "backfill",
                "create",
                "--dag-id",
                "verl_grpo_pipeline",
                "--from-date",
                DATES[0],
                "--to-date",
                DATES[-1],
                "--dag-run-conf",
                json.dumps(conf),
                "--max-active-runs",
                "1",
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if created.returncode == 0:
            break
        # Seen once in CI, not reproducible on the same database at rest: the CLI exited 1 while the freshly started
        # scheduler and DAG processor were writing (SQLite has one writer). A deterministic error fails all 3 tries.
        print(f"backfill create, try {attempt + 1}: exit {created.returncode}\n{created.stderr[-3000:]}")
        time.sleep(10)
    assert created.returncode == 0, created.stderr[-3000:]
    subprocess.run(
        [airflow_bin, "dags", "unpause", "verl_grpo_pipeline"], env=env, check=True, capture_output=True, text=True
    )
    deadline = time.time() + 45 * 60
    runs = []
    while time.time() < deadline:
        out = subprocess.run(
            [airflow_bin, "dags", "list-runs", "verl_grpo_pipeline", "-o", "json"],
            env=env,
            capture_output=True,
            text=True,
        )
        runs = [r for r in cli_json(out.stdout) if r["run_id"].startswith("backfill__")] if out.returncode == 0 else []
        if len(runs) == 3 and all(r["state"] in ("success", "failed") for r in runs):
            break
        time.sleep(15)
    assert len(runs) == 3, runs
    others = [r for r in cli_json(out.stdout) if not r["run_id"].startswith("backfill__")]
    assert not others, f"unexpected non-backfill runs: {others}"
    assert all(r["state"] == "success" for r in runs), (runs, (airflow["home"] / "standalone.log").read_text()[-4000:])
    runs.sort(key=lambda r: r["logical_date"])
    index = json.loads(
        (airflow["home"] / "pipeline" / "hf-cache" / "revision-index" / "openai--gsm8k.json").read_text()
    )
    v1, v2 = index[0]["commit"], index[1]["commit"]
    gsm8k = []
    for r in runs:
        (done,) = [d for d in xcoms(airflow["db"], r["run_id"], "upload_dataset") if d["dataset"] == "gsm8k"]
        gsm8k.append(done)
        assert done["revision"] == done["download"]["commit"]
        assert xcoms(airflow["db"], r["run_id"], "train")[0]["last_step"] >= 1
    assert [d["revision"] for d in gsm8k] == [v1, v1, v2]
    # the second run of the unchanged revision reuses the processed version: no preprocessing, nothing uploaded
    assert gsm8k[0]["preprocess"]["skipped"] is False and gsm8k[1]["preprocess"]["skipped"] is True
    assert gsm8k[1]["upload"]["uploaded"] == 0 and gsm8k[1]["upload"]["bytes_uploaded"] == 0
    assert gsm8k[2]["preprocess"]["skipped"] is False and gsm8k[2]["upload"]["uri"] != gsm8k[0]["upload"]["uri"]
