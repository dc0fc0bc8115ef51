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


def test_operators_given_the_plan_read_no_preset_and_resolve_no_backend(monkeypatch, tmp_path):
    """The train operator and the evaluate/export operator take backend, preset and overrides from the plan (kuberay
    here: the cluster shape, image and mounts come from the plan's preset)."""
    from operators.cluster_step import PipelineStepJobOperator
    from operators.train import GRPOTrainOperator
    from pipeline_steps import constants
    from pipeline_steps.planning import plan
    from pipeline_steps.training import experiment

    monkeypatch.setenv("PIPELINE_MOUNTS", '[{"uri": "oss://verl-store", "claim": "verl-store", "path": "/mnt/store"}]')
    params = {"experiment": "gsm8k_qwen2_5_3b", "backend": "kuberay", "store_uri": "oss://verl-store/verl"}
    run = plan.plan({**params, "rollout_n": 2, "verl_overrides": ["trainer.save_freq=7"]}, None, "r", "d")
    assert run["backend"] == "kuberay" and run["mounts"] == [{"uri": "oss://verl-store", "path": "/mnt/store"}]

    def refused(*args, **kwargs):
        raise AssertionError("read again after the plan")

    monkeypatch.setattr(experiment, "read", refused)
    monkeypatch.setattr(constants, "resolve_backend", refused)
    train = GRPOTrainOperator(task_id="train", plan=run, model_path="oss://verl-store/verl/m", run_dir=run["run_dir"])
    assert train._backend() == "kuberay"
    exp = train._load("kuberay")
    assert exp.verl["actor_rollout_ref.rollout.n"] == 2 and exp.verl["trainer.save_freq"] == 7
    assert exp.verl["trainer.default_local_dir"] == f"{run['run_dir']}/checkpoints"
    assert train._overrides() == run["overrides"]
    step = PipelineStepJobOperator(task_id="evaluate", step="evaluate", plan=run, store_uri=run["store"])
    assert step._backend() == "kuberay" and step._experiment().spec["cluster"] == exp.spec["cluster"]
    assert step._mounts().find(f"{run['store']}/runs")
