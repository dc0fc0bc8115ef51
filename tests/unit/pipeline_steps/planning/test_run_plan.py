"""The typed run plan (issue 48): the plan dict round-trips through RunPlan, a dict missing a key is refused in one
line naming it, RunLayout is the one home of a run's locations, and one function derives the verl keys."""

from __future__ import annotations

import json

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.planning import plan
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.planning.run_plan import DatasetPlan, EvaluationPlan, ModelPlan, RunPlan, from_dict
from pipeline_steps.training.derived_keys import derived_env, derived_keys


@pytest.fixture
def run(monkeypatch, tmp_path) -> dict:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.delenv("PIPELINE_STORE_URI", raising=False)
    return plan.plan({"experiment": "local_tiny", "smoke": True}, None, "manual__1", "d")


def test_the_plan_dict_round_trips_exactly(run):
    typed = RunPlan.from_dict(json.loads(json.dumps(run)))
    assert typed.to_dict() == run and json.loads(json.dumps(typed.to_dict())) == run
    assert all(isinstance(d, DatasetPlan) for d in typed.datasets) and isinstance(typed.model, ModelPlan)
    assert typed.model.name == "tiny" and typed.model.revision == run["model"]["args"][3]
    assert from_dict(run) == typed and RunPlan.from_dict(typed) is typed
    assert typed.layout.run_dir == run["run_dir"] and typed.layout.store == run["store"]
    assert typed.layout.plan_file == f"{run['run_dir']}/plan.json"


@pytest.mark.parametrize("key", ["preset", "steps", "run_dir", "backend"])
def test_a_plan_missing_a_key_is_refused_naming_it(run, key):
    broken = {k: v for k, v in run.items() if k != key}
    with pytest.raises(UserError, match=rf"^plan: no '{key}' in it") as err:
        RunPlan.from_dict(broken)
    assert "\n" not in str(err.value)


def test_a_plan_with_a_backend_other_than_local_or_kuberay_is_refused(run):
    """The plan task resolves the backend once; a plan dict naming another (edited by hand) is refused in one line
    rather than run as a RayJob by the operators, which take the backend from it."""
    with pytest.raises(UserError, match=r"^plan: backend 'slurm': choose 'local' or 'kuberay'") as err:
        RunPlan.from_dict({**run, "backend": "slurm"})
    assert "\n" not in str(err.value)
    evaluation = {k: "x" for k in ("store", "model", "data", "run_key", "dag_id", "run_id")}
    with pytest.raises(UserError, match=r"^evaluation plan: backend None: choose"):
        EvaluationPlan.from_dict({**evaluation, "backend": None, "steps": {}, "carry": {}})


def test_a_dataset_item_missing_a_key_is_refused_naming_the_dataset(run):
    item = {k: v for k, v in run["datasets"][0].items() if k != "steps"}
    with pytest.raises(UserError, match=r"plan dataset '\w+': no 'steps' in it"):
        DatasetPlan.from_dict(item)
    extra = {**run["datasets"][0], "download": {"path": "/x"}}  # a mapped task's carry: what it adds is ignored
    assert DatasetPlan.from_dict(extra).to_dict() == run["datasets"][0]


def test_the_evaluation_plan_round_trips():
    d = {
        "backend": "local",
        "store": "file:///s",
        "model": "file:///m",
        "data": "file:///d/test.parquet",
        "run_key": "k",
        "dag_id": "verl_evaluate_model",
        "run_id": "r",
        "steps": {"evaluate": ["--model", "/m"]},
        "carry": {"evaluate": {"model": "file:///m"}},
    }
    typed = from_dict(d)
    assert isinstance(typed, EvaluationPlan) and typed.to_dict() == d
    assert typed.layout.evaluation("k") == "file:///s/evaluations/k"


def test_run_layout_locations():
    layout = RunLayout.for_run("gs://b/verl/", "gsm8k", "key-1", work="/w")
    run_dir = "gs://b/verl/runs/gsm8k/key-1"
    assert layout.run_dir == run_dir and layout.run_key == "key-1"
    assert layout.checkpoints == f"{run_dir}/checkpoints" and layout.metrics == f"{run_dir}/metrics.jsonl"
    assert layout.rollouts == f"{run_dir}/rollouts" and layout.tensorboard == f"{run_dir}/tensorboard"
    assert layout.eval == f"{run_dir}/eval" and layout.eval_results == f"{run_dir}/eval/results.json"
    assert layout.lineage == f"{run_dir}/lineage.json" and layout.plan_file == f"{run_dir}/plan.json"
    assert layout.mlflow_record == f"{run_dir}/checkpoints/mlflow_run.json"
    assert layout.snapshot("gsm8k", "c0") == "gs://b/verl/snapshots/gsm8k/c0"
    assert layout.processed("gsm8k", "c0", "default") == "gs://b/verl/cache/processed/gsm8k/c0/default"
    assert layout.dataset_version("gsm8k", "c0", "h") == "gs://b/verl/datasets/gsm8k/c0/h"
    assert layout.last_processed("gsm8k") == "gs://b/verl/datasets/gsm8k/last_processed.json"
    assert layout.baseline_cache == "gs://b/verl/cache/baseline"
    assert layout.evaluation("k") == "gs://b/verl/evaluations/k"
    assert layout.export_output == "/w/export/key-1" and layout.snapshot_cache == "/w/snapshots"
    # a reader with only the run directory (or the checkpoints) finds the same layout, store included
    assert RunLayout.for_run_dir(run_dir + "/") == RunLayout(store="gs://b/verl", run_dir=run_dir)
    assert RunLayout.for_checkpoints(layout.checkpoints) == RunLayout(store="gs://b/verl", run_dir=run_dir)
    other = RunLayout.for_checkpoints("gs://b/elsewhere/ckpt")  # the run's other locations beside the checkpoints
    assert other.checkpoints == "gs://b/elsewhere/ckpt" and other.metrics == "gs://b/elsewhere/metrics.jsonl"
    assert other.mlflow_record == "gs://b/elsewhere/ckpt/mlflow_run.json"
    relative = RunLayout.for_checkpoints("checkpoints")  # a relative checkpoint directory: the others beside it
    assert (relative.checkpoints, relative.metrics) == ("checkpoints", "metrics.jsonl")
    assert RunLayout.for_run_dir("/").metrics == "/metrics.jsonl"
    outside = RunLayout.for_run_dir("/tmp/somewhere/run")
    assert outside.store is None and outside.metrics == "/tmp/somewhere/run/metrics.jsonl"
    with pytest.raises(ValueError, match="no store key"):
        outside.baseline_cache


def test_derived_keys_come_from_the_layout_and_the_inputs():
    layout = RunLayout.for_run("oss://b", "e", "k")
    keys = derived_keys(layout, train_files=["oss://b/t.parquet"], val_files=[], model_path="oss://b/m")
    assert keys == {
        "data.train_files": ["oss://b/t.parquet"],
        "data.val_files": [],
        "actor_rollout_ref.model.path": "oss://b/m",
        "trainer.default_local_dir": "oss://b/runs/e/k/checkpoints",
        "trainer.resume_mode": "auto",
    }
    pod = derived_keys(layout, rollouts=True, where=lambda u: u.replace("oss://b", "/mnt"))
    assert pod == {
        "trainer.default_local_dir": "/mnt/runs/e/k/checkpoints",
        "trainer.resume_mode": "auto",
        "trainer.rollout_data_dir": "/mnt/runs/e/k/rollouts",
    }
    assert derived_env(layout, tensorboard=True) == {
        "VERL_FILE_LOGGER_PATH": "oss://b/runs/e/k/metrics.jsonl",
        "TENSORBOARD_DIR": "oss://b/runs/e/k/tensorboard",
    }
