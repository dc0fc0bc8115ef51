"""The production profile's database: Airflow on PostgreSQL with the LocalExecutor, two runs at once.

Real parts: a PostgreSQL 15 cluster of Debian's package started by the test in a temporary directory on a free port,
the pinned psycopg2 driver, `airflow standalone` (scheduler, triggerer, DAG processor, API server) through `make
airflow`'s code path, the whole DAG on the local profile, Airflow's REST API. What it shows:

* two manual runs at once, a ``gpu`` pool of 8 slots and 8 slots per training task: the second run's ``train`` waits
  until the first run's ``train`` has released the pool (their start and end times do not overlap);
* both runs export the same experiment: the store's latest-model pointer ends consistent (contiguous promotion
  records, none torn, the mirror equal to the newest record).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def _as_postgres(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """PostgreSQL refuses to run as root: run its programs as the postgres user when we are root."""
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    from scripts.demo import _free_port

    assert (PG_BIN / "initdb").is_file(), "PostgreSQL 15 is not installed: apt-get install -y postgresql"
    base = Path(f"/tmp/pg-{os.getpid()}")  # short: the Unix socket path is limited to 107 bytes
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    data, port = base / "data", _free_port()
    r = _as_postgres([str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"])
    assert r.returncode == 0, r.stderr
    r = _as_postgres(
        [
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(base / "pg.log"),
            "-w",
            "-o",
            f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c max_connections=200",
            "start",
        ]
    )
    assert r.returncode == 0, r.stderr + (base / "pg.log").read_text()
    try:
        r = _as_postgres([str(PG_BIN.parent / "bin" / "createdb"), "-h", "127.0.0.1", "-p", str(port), "airflow"])
        assert r.returncode == 0, r.stderr
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/airflow"
    finally:
        _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
        shutil.rmtree(base, ignore_errors=True)


def _api(url: str, path: str, method: str = "GET", body: dict | None = None) -> dict:
    req = urllib.request.Request(
        f"{url}/api/v2{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def airflow_pg(postgres, tmp_path_factory):
    from scripts.airflow_local import start, stop
    from scripts.demo import _free_port

    tmp = tmp_path_factory.mktemp("pg-airflow")
    settings = {
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres,
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "VERL_PIPELINE_SCHEDULE": "none",
        "VERL_PIPELINE_MAX_ACTIVE_RUNS": "2",
        "VERL_PIPELINE_GPU_SLOTS": "8",
    }
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    home = tmp / "pipeline"
    try:
        proc, url = start(home, tmp / "airflow-home", _free_port(), tmp / "standalone.log")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                _api(url, "/dags/verl_grpo_pipeline")
                break
            except OSError:
                time.sleep(3)
        yield {"url": url, "home": home, "log": tmp / "standalone.log"}
    finally:
        stop(proc, home)


def _when(ts: str) -> datetime:
    return datetime.fromisoformat(ts.replace("Z", "+00:00"))


def test_two_runs_at_once_queue_on_the_gpu_pool_and_promote_consistently(airflow_pg):
    url = airflow_pg["url"]
    pool = _api(url, "/pools/gpu")
    # a deferred train waits for its job without a worker slot; without include_deferred it would free the pool
    assert pool["slots"] == 8 and pool["include_deferred"] is True
    _api(url, "/dags/verl_grpo_pipeline", "PATCH", {"is_paused": False})
    runs = [
        _api(
            url,
            "/dags/verl_grpo_pipeline/dagRuns",
            "POST",
            {"dag_run_id": f"pg_run_{i}", "logical_date": None, "conf": {"smoke": True}},
        )["dag_run_id"]
        for i in (1, 2)
    ]
    deadline = time.time() + 1800
    states = {}
    while time.time() < deadline:
        states = {r: _api(url, f"/dags/verl_grpo_pipeline/dagRuns/{r}")["state"] for r in runs}
        if all(s in ("success", "failed") for s in states.values()):
            break
        time.sleep(10)
    assert set(states.values()) == {"success"}, (states, Path(airflow_pg["log"]).read_text()[-4000:])
    trains = [_api(url, f"/dags/verl_grpo_pipeline/dagRuns/{r}/taskInstances/train") for r in runs]
    assert all(t["pool"] == "gpu" and t["pool_slots"] == 8 for t in trains)
    (a, b) = sorted(trains, key=lambda t: _when(t["start_date"]))
    # one pool of 8 slots, 8 per task: the second train starts only after the first has ended
    assert _when(b["start_date"]) >= _when(a["end_date"]), (a["start_date"], a["end_date"], b["start_date"])

    from pipeline_steps.evaluation import promotion
    from pipeline_steps.store import open_store

    root = f"file://{airflow_pg['home'] / 'store'}"
    store, exp_uri = open_store(root), promotion.experiment_uri(root, "local_tiny")
    seq, latest = promotion.newest(store, exp_uri)
    names = store.list_names(f"{exp_uri}/latest")
    assert names == [f"{n:08d}.json" for n in range(1, seq + 1)]
    if latest is not None:
        assert json.loads(store.read_bytes(f"{exp_uri}/latest.json")) == latest
