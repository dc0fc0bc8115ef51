"""Plan once, read everywhere (issue 25): one whole ``verl_grpo_pipeline`` run on the local profile reads its preset,
resolves its backend and turns its form into verl overrides once each, in the ``plan`` task; every later task and
operator reads the plan (XCom, or ``plan.json`` in the run directory). The whole-run count is taken in
``tests/e2e/test_cloud_store_dag.py`` (its runs go under :mod:`tests.helpers.count_plan_calls`, sharing their
minutes); this module tests the operators and the plan's parts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


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


def test_step_argv_fills_placeholders_and_drops_empty_optional_flags():
    from pipeline_steps.planning.argv_templates import fact, step_argv

    template = ["--in", fact("a"), "--out", f"/x/{fact('b')}/y", "--opt", fact("c"), "--files", fact("d")]
    assert step_argv(template, {"a": 1, "b": "c0ffee", "c": None, "d": ["p", "q"]}) == [
        "--in",
        "1",
        "--out",
        "/x/c0ffee/y",
        "--files",
        "p",
        "q",
    ]
    with pytest.raises(ValueError, match=r"\{@a\}"):
        step_argv(template, {})


def test_the_plan_records_every_later_steps_argv(monkeypatch, tmp_path):
    """``plan`` writes each step's argv; the request functions only fill in what upstream tasks found."""
    from pipeline_steps.planning import plan, run_requests
    from pipeline_steps.uris import strip_file_scheme

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.delenv("PIPELINE_STORE_URI", raising=False)
    run = plan.plan({"experiment": "local_tiny", "smoke": True, "datasets": ["gsm8k"]}, None, "manual__1", "d")
    assert set(run["steps"]) == {"stage-model", "train-local", "evaluate", "export", "report"}
    assert run["steps"]["stage-model"] == run["model"]["args"]
    (gsm8k,) = [d for d in run["datasets"] if d["dataset"] == "gsm8k"]
    assert run_requests.download_request(gsm8k)["args"] == gsm8k["steps"]["download"]
    done = {**gsm8k, "download": {"path": "/snap", "commit": "abc"}}
    args = run_requests.preprocess_request(done)["args"]
    # tasks share nothing but the store: the preprocessed output is handed over there, not in the work directory
    assert args[args.index("--output") + 1] == f"{run['store']}/cache/processed/gsm8k/abc/default-limit8"
    done["preprocess"] = {"output": "/pp", "content_hash": "f" * 64}
    assert run_requests.upload_request(done)["args"] == [
        "--src",
        "/pp",
        "--dest",
        f"{run['store']}/datasets/gsm8k/abc/{'f' * 16}",
    ]
    argv = run_requests.train_local_argv(
        run, {"plan_file": "/p.json", "train_files": ["/t"], "val_files": [], "model_path": "/m", "output_dir": "/o"}
    )
    assert argv == [
        "train-local",
        "--plan",
        "/p.json",
        "--train-files",
        "/t",
        "--model-path",
        "/m",
        "--output-dir",
        "/o",
    ]
    report = run_requests.report_request(run, None, None, None, {"train": "failed"})["args"]
    assert report == ["--run-dir", strip_file_scheme(run["run_dir"]), "--task-states", '{"train": "failed"}']


def test_a_preset_edited_after_plan_does_not_change_what_train_runs(monkeypatch, tmp_path):
    """train-local given the plan (``--plan plan.json``) runs the preset as planned and reads no preset file: an
    edit of the file after ``plan`` is ignored. A plan.json whose preset no longer matches its hash is refused."""
    import argparse
    import json
    import shutil

    from pipeline_steps.errors import UserError
    from pipeline_steps.planning import plan, plan_io
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    presets = tmp_path / "presets"
    presets.mkdir()
    shutil.copy(experiment.resolve_path("local_tiny"), presets / "my_tiny.yaml")
    monkeypatch.setenv("PIPELINE_PRESETS_DIR", str(presets))
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.delenv("PIPELINE_STORE_URI", raising=False)
    run = plan.plan({"experiment": "my_tiny", "learning_rate": 1e-5}, None, "manual__1", "d")
    plan_file = plan_io.save(run).removeprefix("file://")
    planned_lr = experiment.from_plan(run).verl["actor_rollout_ref.actor.optim.lr"]

    text = (presets / "my_tiny.yaml").read_text()  # the preset file edited after plan
    assert "trainer.total_training_steps: 3\n" in text
    (presets / "my_tiny.yaml").write_text(
        text.replace("trainer.total_training_steps: 3\n", "trainer.total_training_steps: 999\n")
    )
    assert experiment.load("my_tiny").verl["trainer.total_training_steps"] == 999

    def refused(*args, **kwargs):
        raise AssertionError("train-local read a preset file")

    monkeypatch.setattr(experiment, "read", refused)
    args = argparse.Namespace(plan=plan_file, experiment=None, override=[])
    exp = train_local.load_experiment(args, {"trainer.default_local_dir": "/o/checkpoints"})
    assert exp.digest() == experiment.from_plan(run, {"trainer.default_local_dir": "/o/checkpoints"}).digest()
    assert exp.verl.get("trainer.total_training_steps") != 999
    assert exp.verl["actor_rollout_ref.actor.optim.lr"] == planned_lr == 1e-5

    tampered = json.loads(open(plan_file).read())
    tampered["preset"]["verl"]["trainer.total_training_steps"] = 999
    open(plan_file, "w").write(json.dumps(tampered))
    with pytest.raises(UserError, match="preset_sha256"):
        train_local.load_experiment(args, {})
    with pytest.raises(UserError, match="overrides"):
        train_local.load_experiment(argparse.Namespace(plan=plan_file, experiment=None, override=["a.b=1"]), {})


def test_the_evaluation_dag_plans_once_and_its_operator_runs_the_plans_argv(monkeypatch, tmp_path):
    """verl_evaluate_model: its plan task makes a small plan (backend, store, the evaluate step's argv); its operator
    takes the plan (no experiment, no backend) and runs exactly the plan's argv."""
    import json
    import runpy

    from airflow.sdk.definitions.xcom_arg import XComArg

    from operators.cluster_step import PipelineStepJobOperator
    from pipeline_steps.errors import UserError
    from pipeline_steps.planning.evaluation_run import evaluation_plan

    store = tmp_path / "store"
    (store / "datasets" / "gsm8k").mkdir(parents=True)
    (store / "datasets" / "gsm8k" / "last_processed.json").write_text(json.dumps({"uri": f"file://{store}/d/v1"}))
    params = {"model_uri": "", "eval_dataset": "gsm8k", "eval_data_uri": "", "k": 2, "temperature": 1.0}
    params.update(top_p=1.0, max_new_tokens=8, store_uri=f"file://{store}")
    run = evaluation_plan(params, f"file://{store}/models/m/v1", "manual__1", "verl_evaluate_model")
    argv = run["steps"]["evaluate"]
    assert run["backend"] == "local" and argv[:4] == [
        "--model",
        f"{store}/models/m/v1",
        "--data",
        f"{store}/d/v1/test.parquet",
    ]
    assert argv[argv.index("--k") + 1] == "2"
    with pytest.raises(UserError, match="model_uri"):
        evaluation_plan(params, None, "r", "d")

    dag = runpy.run_path(str(ROOT / "dags" / "verl_evaluate_model.py"))["dag"]
    op = dag.get_task("evaluate")
    assert isinstance(op.plan, XComArg) and not op.request  # the backend and the argv: the plan's
    launched = []
    monkeypatch.setattr(
        "operators.step.PipelineStepOperator.execute", lambda self, context: launched.append(self.request["args"])
    )
    PipelineStepJobOperator(task_id="evaluate", step="evaluate", plan=run, store_uri=run["store"]).execute({})
    assert launched == [argv]
