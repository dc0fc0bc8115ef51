"""Plan once, read everywhere (issue 25): one whole ``verl_grpo_pipeline`` run on the local profile reads its preset,
resolves its backend and turns its form into verl overrides once each, in the ``plan`` task; every later task and
operator reads the plan (XCom, or ``plan.json`` in the run directory). The whole-run count is taken in
``tests/test_user_jsonl_dag.py`` (its run goes under :mod:`tests.helpers.count_plan_calls`, sharing that run's
minutes); this module tests the operators and the plan's parts.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
