"""Plan once, read everywhere (issue 25): one whole ``verl_grpo_pipeline`` run on the local profile reads its preset,
resolves its backend and turns its form into verl overrides once each, in the ``plan`` task; every later task and
operator reads the plan (XCom, or ``plan.json`` in the run directory). Counted by running ``airflow dags test`` under
:mod:`tests.count_plan_calls`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.budget(900)
def test_one_run_reads_the_preset_resolves_the_backend_and_the_overrides_once(tmp_path):
    from scripts.demo import newest_run, prepare, stop_services, task_states, xcom

    home, airflow_home = tmp_path / "pipeline", tmp_path / "airflow"
    env = prepare(home, airflow_home)
    counts_file = tmp_path / "counts.json"
    env["PIPELINE_CALL_COUNTS"] = str(counts_file)
    conf = {"experiment": "local_tiny", "smoke": True, "learning_rate": 1e-5}
    logical = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    try:
        with open(tmp_path / "pipeline.log", "w") as log:
            rc = subprocess.run(
                [sys.executable, "-m", "tests.count_plan_calls", "dags", "test", "verl_grpo_pipeline", logical]
                + ["--conf", json.dumps(conf)],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=1200,
            ).returncode
        text = (tmp_path / "pipeline.log").read_text()
        assert rc == 0, text[-6000:]
        db = airflow_home / "airflow.db"
        run_id = newest_run(db, "verl_grpo_pipeline")
        states = task_states(db, run_id)
        assert states and all(s == "success" for t, s in states.items() if t != "export[-1]"), states
        recorded = json.loads(counts_file.read_text())
        print(json.dumps(recorded, indent=2))
        counts = recorded["counts"]
        assert counts == {"preset_loads": 1, "backend_resolutions": 1, "overrides_computations": 1}, recorded

        plan = xcom(db, run_id, "plan", "run")[0]
        written = json.loads(Path(plan["run_dir"].removeprefix("file://"), "plan.json").read_text())
        assert written == plan
        assert plan["backend"] == "local" and plan["overrides"][0] == "actor_rollout_ref.actor.optim.lr=1e-05"
        lineage = json.loads(Path(plan["run_dir"].removeprefix("file://"), "lineage.json").read_text())
        assert lineage["experiment"]["preset_sha256"] == plan["preset_sha256"]
        assert lineage["experiment"]["overrides"] == plan["overrides"]
    finally:
        stop_services(home)
