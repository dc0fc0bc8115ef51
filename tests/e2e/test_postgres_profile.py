"""The production profile's database: Airflow on PostgreSQL with the LocalExecutor, two runs at once.

Real parts: a PostgreSQL 15 cluster of Debian's package started by the test in a temporary directory on a free port,
the pinned psycopg2 driver, Airflow's scheduler, triggerer, DAG processor and API server through `make airflow`'s
code path, the whole DAG on the local profile, Airflow's REST API. What it shows:

* a backfill over two dates with two active runs that resolve the same dataset revisions, their Asset
  registrations forced to meet (tests/helpers/airflow_plugins/force_asset_race.py, fault injection in the API server,
  not the product): every run succeeds, and no two registrations of one new Asset ever met (Airflow 3.3's
  check-then-insert race, issue 29: on the code before operators/assets.py two of the four runs lost their upload task);
* the same two runs on a ``gpu`` pool of 8 slots and 8 slots per training task: no two training jobs hold the GPUs
  at once (their start and end times do not overlap);
* all runs export the same experiment: the store's latest-model pointer ends consistent (contiguous promotion
  records, none torn, the mirror equal to the newest record);
* every Airflow process (scheduler, triggerer, the LocalExecutor's task processes) killed while ``train`` is
  deferred, then Airflow started again: the run completes with exactly one training job submitted;
* that run, a third on the revisions the backfill resolved, reuses their processed versions: no preprocessing, nothing
  uploaded (tests/e2e/test_scheduling.py's UI backfill shows a new revision making a new version).

The two tests share one PostgreSQL cluster and one Airflow (module fixtures), in file order: the backfill first, so
its dataset versions are new Assets when its two runs register them. Two runs, not four as at first: two already
give the forced race two registrants of each new Asset and the pool a pair of jobs to keep apart; each further run
cost a whole-DAG run of make test's CPU (about a minute of its wall time) and added no claim.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.airflow_api import api

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def airflow_pg(postgres, tmp_path_factory):
    from scripts.airflow_local import start, stop
    from scripts.local_profile import _free_port

    tmp = tmp_path_factory.mktemp("pg-airflow")
    race = tmp / "asset-race"
    race.mkdir()
    settings = {
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(Path(__file__).parents[1] / "helpers" / "airflow_plugins"),
        "ASSET_RACE_DIR": str(race),
        "ASSET_RACE_WAIT": "20",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres,
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        # weekly, ending on the backfill's last date: no scheduled run competes with the runs the tests make
        "PIPELINE_SCHEDULE": "@weekly",
        "PIPELINE_END_DATE": DATES[-1],
        "PIPELINE_MAX_ACTIVE_RUNS": str(len(DATES)),
        "PIPELINE_GPU_SLOTS": "8",
    }
    home = tmp / "pipeline"
    state = {"home": home, "log": tmp / "standalone.log", "airflow_home": tmp / "airflow-home", "race": race}

    def up():
        old = {k: os.environ.get(k) for k in settings}
        os.environ.update(settings)
        try:
            state["proc"], state["url"] = start(home, tmp / "airflow-home", _free_port(), state["log"])
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.update({k: v})
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                api(state["url"], "/dags/verl_grpo_pipeline")
                return
            except OSError:
                time.sleep(3)

    state["up"] = up
    up()
    try:
        yield state
    finally:
        stop(state["proc"], home)


# two weekly dates after the fixture Hub's newest gsm8k (2026-10-15) and AIME (2026-10-01) commits: both runs
# resolve the same dataset revisions, so they upload the same versions and register the same new Assets
DATES = ["2026-10-18", "2026-10-25"]


def _wait_runs(url: str, runs: list[str], timeout: float = 1800) -> dict:
    deadline = time.time() + timeout
    states = {}
    while time.time() < deadline:
        states = {r: api(url, f"/dags/verl_grpo_pipeline/dagRuns/{r}")["state"] for r in runs}
        if all(s in ("success", "failed") for s in states.values()):
            break
        time.sleep(10)
    return states


def _uploads(url: str, run: str) -> dict[str, dict]:
    """``{dataset: upload_dataset's result}`` of one run, through the REST API (the task is mapped over datasets)."""
    out = {}
    for i in range(2):  # gsm8k and AIME 2024
        path = f"/dags/verl_grpo_pipeline/dagRuns/{run}/taskInstances/upload_dataset/xcomEntries/return_value"
        value = api(url, f"{path}?map_index={i}")["value"]
        value = json.loads(value) if isinstance(value, str) else value
        out[value["dataset"]] = value
    return out


def _why(airflow_pg: dict, states: dict) -> str:
    """For an assertion message: each failed run's unsuccessful tasks and the tail of their last attempt's log."""
    lines = [json.dumps(states)]
    for run, state in states.items():
        if state == "success":
            continue
        tis = api(airflow_pg["url"], f"/dags/verl_grpo_pipeline/dagRuns/{run}/taskInstances?limit=100")
        for ti in tis["task_instances"]:
            if ti["state"] in ("success", "skipped"):
                continue
            lines.append(f"{run} {ti['task_id']}[{ti['map_index']}]: {ti['state']} (try {ti['try_number']})")
            logs = Path(airflow_pg["airflow_home"]) / "logs" / "dag_id=verl_grpo_pipeline" / f"run_id={run}"
            mapped = f"map_index={ti['map_index']}/" if ti["map_index"] >= 0 else ""
            for f in sorted(logs.glob(f"task_id={ti['task_id']}/{mapped}attempt=*.log"))[-1:]:
                lines += f.read_text(errors="replace").splitlines()[-25:]
    return "\n".join(lines)


@pytest.mark.budget(1200)  # 997 s measured at a load average of 10 (four sessions on 2 cores)
def test_two_runs_sharing_dataset_versions_all_succeed_queue_on_the_gpu_pool_and_promote_consistently(airflow_pg):
    url = airflow_pg["url"]
    pool = api(url, "/pools/gpu")
    # a deferred train waits for its job without a worker slot; without include_deferred it would free the pool
    assert pool["slots"] == 8 and pool["include_deferred"] is True
    api(url, "/dags/verl_grpo_pipeline", "PATCH", {"is_paused": False})
    backfill = api(
        url,
        "/backfills",
        "POST",
        {
            "dag_id": "verl_grpo_pipeline",
            "from_date": f"{DATES[0]}T00:00:00Z",
            "to_date": f"{DATES[-1]}T00:00:00Z",
            "max_active_runs": len(DATES),
            "dag_run_conf": {"smoke": True},
            "reprocess_behavior": "none",
        },
    )
    assert backfill["max_active_runs"] == len(DATES)
    deadline = time.time() + 120
    runs = []
    while time.time() < deadline and len(runs) < len(DATES):
        runs = [
            r["dag_run_id"]
            for r in api(url, "/dags/verl_grpo_pipeline/dagRuns?limit=100")["dag_runs"]
            if (r["logical_date"] or "")[:10] in DATES
        ]
        time.sleep(3)
    assert len(runs) == len(DATES), runs
    states = _wait_runs(url, runs)
    assert set(states.values()) == {"success"}, _why(airflow_pg, states)
    # the same revisions: every run registered the same dataset versions, each one Asset
    emitted: dict[str, set] = {r: set() for r in runs}
    for e in api(url, "/assets/events?limit=1000")["asset_events"]:
        if e["source_run_id"] in emitted and "/datasets/" in e["uri"]:
            emitted[e["source_run_id"]].add(e["uri"])
    assert len({frozenset(v) for v in emitted.values()}) == 1 and len(emitted[runs[0]]) == 2, emitted
    # the injection was active and no two creations of one new Asset met (each waited alone for its 20 s)
    events = (airflow_pg["race"] / "events.log").read_text().splitlines()
    assert any(e.startswith("alone gsm8k@") for e in events) and any(e.startswith("alone aime2024@") for e in events)
    assert not [e for e in events if e.startswith("met ")], events
    trains = [api(url, f"/dags/verl_grpo_pipeline/dagRuns/{r}/taskInstances/train") for r in runs]
    assert all(t["pool"] == "gpu" and t["pool_slots"] == 8 for t in trains)
    # One pool of 8 slots, 8 per task: the training jobs never hold the GPUs at once. Measured on the jobs (Ray's
    # start and end times), not on the train tasks: when a job ends its task leaves `deferred` for `scheduled` to run
    # execute_complete, Airflow stops counting it against the pool (apache/airflow#69187), and another run's train
    # may take the slots first; the first task then ends only after the next job (#57210).
    from operators.backends import submission_base
    from pipeline_steps.local import ray_cluster
    from scripts.local_profile import ray_temp_dir

    address = json.loads((ray_temp_dir(airflow_pg["home"]) / ray_cluster.STATE_FILE).read_text())["address"]
    listed = ray_cluster._client(address, ray_temp_dir(airflow_pg["home"]) / "auth_token").list_jobs()
    jobs = []
    for r in runs:
        base = submission_base("verl_grpo_pipeline", r, "train")
        (job,) = [j for j in listed if (j.submission_id or "").startswith(base)]
        jobs.append(job)
    jobs.sort(key=lambda j: j.start_time)
    for a, b in zip(jobs, jobs[1:]):
        assert a.end_time and b.start_time >= a.end_time, (a.submission_id, a.end_time, b.start_time)
    figures = {  # for the record (the closing note quotes them): in the test's directory, and on stdout with -s
        "jobs_s": [(j.end_time - j.start_time) / 1e3 for j in jobs],
        "gaps_between_jobs_s": [(b.start_time - a.end_time) / 1e3 for a, b in zip(jobs, jobs[1:])],
        "asset_race_events": events,
    }
    (airflow_pg["home"] / "queue-figures.json").write_text(json.dumps(figures, indent=1))
    print("queue figures:", json.dumps(figures))

    from pipeline_steps.evaluation import promotion
    from pipeline_steps.store import open_store

    root = f"file://{airflow_pg['home'] / 'store'}"
    store, exp_uri = open_store(root), promotion.experiment_uri(root, "local_tiny")
    seq, latest = promotion.newest(store, exp_uri)
    names = store.list_names(f"{exp_uri}/latest")
    assert names == [f"{n:08d}.json" for n in range(1, seq + 1)]
    if latest is not None:
        assert json.loads(store.read_bytes(f"{exp_uri}/latest.json")) == latest


@pytest.mark.budget(900)  # 111 s on an idle machine, 519 s at a load average of 10, over 600 s at 20
def test_killing_airflow_while_train_is_deferred_submits_no_second_job(airflow_pg):
    from pipeline_steps.local import ray_cluster

    url = airflow_pg["url"]
    api(url, "/dags/verl_grpo_pipeline", "PATCH", {"is_paused": False})
    run = api(
        url,
        "/dags/verl_grpo_pipeline/dagRuns",
        "POST",
        {"dag_run_id": "pg_kill", "logical_date": None, "conf": {"smoke": True}},
    )["dag_run_id"]
    deadline = time.time() + 600  # internal waits (600 + 600 s) stay under the test's timeout (three times its budget)
    state = None
    while time.time() < deadline:
        try:
            state = api(url, f"/dags/verl_grpo_pipeline/dagRuns/{run}/taskInstances/train")["state"]
        except OSError:
            state = None
        if state in ("deferred", "success", "failed"):
            break
        time.sleep(2)
    assert state == "deferred", state
    proc = airflow_pg["proc"]
    os.killpg(proc.pid, signal.SIGKILL)  # scheduler, triggerer, API server and the task's processes, no goodbye
    proc.wait(30)
    airflow_pg["up"]()  # the same database; Airflow notices the dead task and the triggerer resumes waiting
    states = _wait_runs(airflow_pg["url"], [run], timeout=600)
    assert states[run] == "success", Path(airflow_pg["log"]).read_text()[-4000:]
    from scripts.local_profile import ray_temp_dir

    address = json.loads((ray_temp_dir(airflow_pg["home"]) / ray_cluster.STATE_FILE).read_text())["address"]
    client = ray_cluster._client(address, ray_temp_dir(airflow_pg["home"]) / "auth_token")  # the cluster's token
    jobs = [j for j in client.list_jobs() if "-train-" in (j.submission_id or "")]
    from operators.backends import submission_base

    base = submission_base("verl_grpo_pipeline", run, "train")
    assert [j.submission_id for j in jobs if j.submission_id.startswith(base)] == [f"{base}-a0"]  # exactly one job
    # A third run of the revisions the backfill resolved: it finds their processed versions in the store, so it
    # preprocesses and uploads nothing, and trains on the backfill's versions.
    url = airflow_pg["url"]  # the restarted API server's
    backfilled = [
        r["dag_run_id"]
        for r in api(url, "/dags/verl_grpo_pipeline/dagRuns?limit=100")["dag_runs"]
        if r["run_type"] == "backfill"
    ]
    assert backfilled, "the backfill test's runs are this one's baseline: run the module, not this test alone"
    before = {d["upload"]["uri"] for r in backfilled for d in _uploads(url, r).values()}
    again = _uploads(url, run)
    assert set(again) == {"gsm8k", "aime2024"}, again
    for d in again.values():
        assert d["preprocess"]["skipped"] is True, d  # (the revision is "main": a run with no logical date)
        assert (d["upload"]["uploaded"], d["upload"]["bytes_uploaded"]) == (0, 0) and d["upload"]["uri"] in before, d
