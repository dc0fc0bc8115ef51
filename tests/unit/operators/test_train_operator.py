"""GRPOTrainOperator, driven for real the way Airflow runs a deferrable task:
``execute`` -> ``TaskDeferred`` -> the trigger's async generator -> ``execute_complete``.

Local backend: nothing is mocked. A real local Ray cluster (``pipeline_steps.local.ray_cluster``,
on private ports and temp dir) runs the real ``train-local`` step (CPU GRPO on the tiny
model); the trigger polls it through Ray's ``JobSubmissionClient``. A failure is injected
through verl's own ``reward.custom_reward_function`` seam after the first checkpoint;
the retry must start a new attempt that resumes from that checkpoint.

KubeRay backend: the Kubernetes API is the stand-in of ``tests/helpers/k8s_api_stand_in.py``
(see its docstring for what it does not cover); the RayJob body is rendered by the real
``pipeline_steps.training.rayjob_manifest.build_rayjob``. The operator is attached to a real ``DAG``
object and gets a context holding ``run_id`` (no task instance: the XCom push of the
dashboard link is not exercised here).
"""

from __future__ import annotations

import json
import shlex

import pytest
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowFailException

from operators.failures import JobFailed
from operators.train import GRPOTrainOperator
from tests.helpers.deferral import deferred, run_trigger
from tests.helpers.operator_runs import RUN_ID, write_parquet
from tests.helpers.rayjob_operators import read_through_mounts, train_plan

REWARD = """\
from pathlib import Path

FAIL, TRACKER = Path({fail!r}), Path({tracker!r})


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if FAIL.exists() and TRACKER.exists():  # fail the job once the first checkpoint is written
        raise RuntimeError("injected failure after the first checkpoint")
    return float(len(set(solution_str)) % 3)  # differs within a group: a learning signal
"""


def test_bad_override_fails_in_preflight_without_retry(tmp_path, tiny_model):
    train = write_parquet(tmp_path / "train.parquet")
    run = train_plan("local_tiny", "local", f"file://{tmp_path}/store", ["actor_rollout_ref.actor.optim.lrr=1e-6"])
    with DAG("t_preflight", schedule=None):
        op = GRPOTrainOperator(
            task_id="train",
            plan=run,
            train_files=[str(train)],
            model_path=str(tiny_model),
            run_dir=str(tmp_path / "run"),
        )
    with pytest.raises(AirflowFailException, match=r"pre-flight: .*actor_rollout_ref\.actor\.optim\.lrr"):
        op.execute({"run_id": RUN_ID})
    assert not (tmp_path / "run").exists()  # nothing was submitted


@pytest.mark.slow
def test_local_backend_trains_fails_then_retry_resumes_from_checkpoint(
    tmp_path, tiny_model, ray_cluster, capsys, monkeypatch, request
):
    from mlflow.tracking import MlflowClient

    from pipeline_steps.local import mlflow_server
    from pipeline_steps.local import ray_cluster as local_ray

    # local_tiny logs to MLflow: the operator starts the embedded server here (not in the repo's .demo)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PIPELINE_MLFLOW_DIR", str(tmp_path / "mlflow"))
    request.addfinalizer(lambda: mlflow_server.shutdown_server(tmp_path / "mlflow"))  # after every attempt below

    train = write_parquet(tmp_path / "train.parquet")
    run_dir = tmp_path / "run"
    fail = tmp_path / "fail-now"
    fail.touch()
    reward = tmp_path / "reward.py"
    reward.write_text(
        REWARD.format(fail=str(fail), tracker=str(run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"))
    )
    overrides = [
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.total_training_steps=3",
        "actor_rollout_ref.rollout.n=2",
    ]
    run = train_plan("local_tiny", "local", f"file://{tmp_path}/store", overrides, f"file://{run_dir}", save=True)

    def make_op():
        with DAG("t_local", schedule=None):
            return GRPOTrainOperator(
                task_id="train",
                plan=run,
                train_files=[str(train)],
                model_path=str(tiny_model),
                run_dir=f"file://{run_dir}",
                ray_address=ray_cluster,
                poll_interval=1.0,
            )

    first = make_op()
    trigger = deferred(first, {"run_id": RUN_ID})
    assert trigger.submission_id.endswith("-a0")
    event = run_trigger(trigger, timeout=420)
    assert event["status"] == "error" and "FAILED" in event["message"], event
    with pytest.raises(JobFailed, match="ended FAILED"):
        first.execute_complete({"run_id": RUN_ID}, event)
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"

    fail.unlink()  # the cause goes away; Airflow retries the task
    retry = make_op()
    trigger = deferred(retry, {"run_id": RUN_ID})
    assert trigger.submission_id.endswith("-a1")
    info = local_ray.info(ray_cluster, trigger.submission_id)
    argv = shlex.split(info["entrypoint"])
    assert not any("resume_mode" in a for a in argv)  # train-local always resumes from its output's checkpoints
    # same run dir, so the same checkpoint dir: the store URI (the job fetches and commits it itself, issue 45)
    assert argv[argv.index("--output-dir") + 1] == f"file://{run_dir}"
    event = run_trigger(trigger, timeout=420)
    assert event["status"] == "success", event
    out = retry.execute_complete({"run_id": RUN_ID}, event)
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == 1  # it did resume
    assert out["backend"] == "local" and out["last_step"] == 3 and out["checkpoint_step"] == 3
    assert out["checkpoint_uri"] == f"file://{run_dir}/checkpoints"
    assert {"critic/score/mean", "actor/entropy", "response_length/mean"} <= set(out["metrics"])
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == 1 and summary["last_step"] == 3
    assert "progress step 3:" in capsys.readouterr().out
    # the retry continued the first attempt's MLflow run: one run with every step, and the XCom names it
    for k, v in mlflow_server.client_env(tmp_path / "mlflow").items():  # the embedded server wants its login
        monkeypatch.setenv(k, v)
    client = MlflowClient(tracking_uri=out["mlflow"]["tracking_uri"])
    assert out["mlflow"]["run_id"] == summary["mlflow"]["run_id"]
    history = client.get_metric_history(out["mlflow"]["run_id"], "critic/score/mean")
    assert sorted({m.step for m in history}) == [1, 2, 3]
    assert len(client.search_runs([out["mlflow"]["experiment_id"]])) == 1

    # a worker restarted after success re-attaches to the finished attempt: nothing is submitted again
    again = deferred(make_op(), {"run_id": RUN_ID})
    assert again.submission_id == trigger.submission_id
    assert run_trigger(again, timeout=60)["status"] == "success"


def test_kuberay_backend_renders_fails_and_retry_resumes_same_checkpoint_dir(k8s_api, tmp_path, monkeypatch, capsys):
    """The cluster path of the train task: pre-flight, B1's real render, the stand-in API server."""
    from pipeline_steps.training.rayjob_manifest import rayjob_name
    from tests.helpers.k8s_api_stand_in import SUCCESS

    api = k8s_api
    mnt = tmp_path / "mnt"
    monkeypatch.setenv(
        "PIPELINE_MOUNTS", json.dumps([{"uri": "gs://verl-bucket", "claim": "verl-store", "path": str(mnt)}])
    )
    read_through_mounts(monkeypatch)  # the worker reads the run directory at its mount path (no bucket here)
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)
    run_dir = "gs://verl-bucket/runs/gsm8k/run1"
    name = rayjob_name("t_kuberay", RUN_ID, "train", "train")
    metrics = mnt / "runs/gsm8k/run1/metrics.jsonl"
    api.script(
        name,
        [
            {"jobDeploymentStatus": "Initializing"},
            {
                "jobDeploymentStatus": "Running",
                "jobStatus": "RUNNING",
                "log": ["step 1 done"],
                "metrics": [{"step": 1, "data": {"critic/score/mean": 0.1}}],
            },
            {
                "jobDeploymentStatus": "Complete",
                "jobStatus": "FAILED",
                "reason": "AppFailed",
                "message": "Job entrypoint command failed with exit code 1",
            },
        ],
        metrics_file=metrics,
    )
    api.script(
        name[:44].rstrip("-") + "-r1",
        [
            *SUCCESS[:-1],
            {**SUCCESS[-1], "metrics": [{"step": 2, "data": {"critic/score/mean": 0.4, "timing_s/step": 3.0}}]},
        ],
        metrics_file=metrics,
    )

    overrides = ["trainer.total_training_steps=2", "trainer.experiment_name=x'; echo $(id) `id`\n"]
    run = train_plan("gsm8k_qwen2_5_3b", "kuberay", "gs://verl-bucket", overrides, run_dir)

    def make_op():
        with DAG("t_kuberay", schedule=None):
            return GRPOTrainOperator(
                task_id="train",
                plan=run,
                namespace="training",
                train_files=["gs://verl-bucket/datasets/gsm8k/train.parquet"],
                val_files=["gs://verl-bucket/datasets/gsm8k/test.parquet"],
                model_path="gs://verl-bucket/models/Qwen/Qwen2.5-3B-Instruct/main",
                run_dir=run_dir,
                check_store=False,
                kubernetes_conn_id="k8s_standin",
                poll_interval=0.01,
            )

    first = make_op()
    trigger = deferred(first, {"run_id": RUN_ID})
    assert trigger.name == name and trigger.submission_mode == "HTTPMode"
    event = run_trigger(trigger, timeout=60)
    assert event["log_tail"] == ["step 1 done"]  # read through the (stand-in) Ray dashboard Jobs API
    with pytest.raises(JobFailed, match="jobStatus=FAILED.*exit code 1"):
        first.execute_complete({"run_id": RUN_ID}, event)

    retry = make_op()
    trigger = deferred(retry, {"run_id": RUN_ID})
    assert trigger.name.endswith("-r1") and api.deletes == [name] and api.count_creates() == 2
    old, new = (shlex.split(b["spec"]["entrypoint"]) for b in api.creates)

    def arg(argv, key):  # the value of a Hydra override (B1 renders values as quoted Hydra literals)
        found = [a for a in argv if a.startswith(key + "=")]
        assert len(found) == 1, (key, found)
        return found[0].split("=", 1)[1]

    ckpt = arg(old, "trainer.default_local_dir")
    assert ckpt.strip("'\"") == f"{mnt}/runs/gsm8k/run1/checkpoints" and arg(new, "trainer.default_local_dir") == ckpt
    assert arg(new, "trainer.resume_mode").strip("'\"") == "auto"
    # the untrusted override stayed one argument, with its quote, $(), backticks and newline inside
    name_arg = arg(new, "trainer.experiment_name")
    assert all(x in name_arg for x in ("echo $(id)", "`id`", "\n", "x"))
    event = run_trigger(trigger, timeout=60)
    out = retry.execute_complete({"run_id": RUN_ID}, event)
    assert out["backend"] == "kuberay" and out["last_step"] == 2 and out["metrics"]["critic/score/mean"] == 0.4
    assert out["checkpoint_uri"] == f"{run_dir}/checkpoints"
    assert "progress step 2: critic/score/mean=0.4" in capsys.readouterr().out


def test_kuberay_train_honours_the_presets_cluster_mounts_as_plan_does(k8s_api, tmp_path, monkeypatch):
    """A preset's ``cluster.mounts`` (no $PIPELINE_MOUNTS in the deployment): plan accepts the store, so train must
    render the RayJob with those mounts instead of failing on a store "outside every mounted bucket"."""
    import yaml

    from pipeline_steps.training import experiment

    preset = yaml.safe_load(experiment.resolve_path("gsm8k_qwen2_5_3b").read_text())
    preset["name"] = "team_gsm8k"
    preset.setdefault("cluster", {})["mounts"] = [
        {"uri": "gs://team-bucket", "claim": "team-store", "path": "/mnt/team"}
    ]
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "team_gsm8k.yaml").write_text(yaml.safe_dump(preset))
    monkeypatch.setenv(experiment.PRESETS_ENV, str(presets))
    monkeypatch.delenv("PIPELINE_MOUNTS", raising=False)
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)
    run = train_plan("team_gsm8k", "kuberay", "gs://team-bucket", run_dir="gs://team-bucket/runs/gsm8k/run1")
    with DAG("t_mounts", schedule=None):
        op = GRPOTrainOperator(
            task_id="train",
            plan=run,
            namespace="training",
            train_files=["gs://team-bucket/datasets/gsm8k/train.parquet"],
            val_files=["gs://team-bucket/datasets/gsm8k/test.parquet"],
            model_path="gs://team-bucket/models/Qwen/Qwen2.5-3B-Instruct/main",
            run_dir="gs://team-bucket/runs/gsm8k/run1",
            check_store=False,
            kubernetes_conn_id="k8s_standin",
            poll_interval=0.01,
        )
    deferred(op, {"run_id": RUN_ID})
    (body,) = k8s_api.creates
    claims = json.dumps(body["spec"]["rayClusterSpec"])
    assert (
        '"claimName": "team-store"' in claims and "/mnt/team/datasets/gsm8k/train.parquet" in body["spec"]["entrypoint"]
    )
