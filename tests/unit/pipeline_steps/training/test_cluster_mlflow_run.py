"""The cluster run's MLflow run id in the lineage (issue 15 item 4), against a real MLflow server started here.

The cluster's training entrypoint (``pipeline_steps.training.verl_main``) starts the MLflow run before verl does,
records it beside the checkpoints (``mlflow_run.json``, as the CPU trainer does) and gives its id to verl's actors
as ``$MLFLOW_RUN_ID`` through the runtime env of ``main_ppo``'s ``ray.init``. Checked here:

* the record-writing alone (new run, resumed attempt, restart without checkpoint, server away);
* the whole hand-over through a real Ray job: verl's own ``run_ppo`` with the patched runtime env, Ray's merge with
  the job's runtime env, and verl's own ``Tracking`` in an actor attaching to the recorded run (one run, not two);
* the train task's kuberay path: the entrypoint's config composed from the rendered RayJob's own argv, the record on
  the bucket mount read back into the XCom; and the report of a cluster run (no ``train_summary.json``).

``main_ppo`` itself needs GPUs; what runs instead of its trainer is one actor logging two steps through ``Tracking``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest
import yaml
from airflow.sdk import DAG

from tests.helpers.operator_runs import RUN_ID
from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[4]
IMAGE = "registry.example.com/verl-grpo-train@sha256:" + "0" * 64


@pytest.fixture(scope="module")
def server_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="module")
def server(server_dir):
    from pipeline_steps.local import mlflow_server

    uri = mlflow_server.ensure_server(server_dir)
    yield uri
    mlflow_server.shutdown_server(server_dir)


def _login(monkeypatch, server_dir) -> dict[str, str]:
    """The embedded server's generated login (issue 46) into this process's environment, where MLflow's client
    reads it (the autouse ``_clean_env`` clears it before each test)."""
    from pipeline_steps.local import mlflow_server

    creds = mlflow_server.client_env(server_dir)
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    return creds


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(var, raising=False)


def _config(ckpt: Path, logger=("console", "file", "mlflow"), project="cluster_proj", name="cluster_run"):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "trainer": {
                "logger": list(logger),
                "project_name": project,
                "experiment_name": name,
                "default_local_dir": str(ckpt),
            }
        }
    )


def test_the_entrypoint_starts_records_and_resumes_the_run(server, server_dir, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from pipeline_steps import tracking_run
    from pipeline_steps.training import verl_main

    _login(monkeypatch, server_dir)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    ckpt = tmp_path / "checkpoints"
    first = verl_main.mlflow_run(_config(ckpt))
    assert first == tracking_run.read(ckpt) and first["tracking_uri"] == server
    assert first["url"] == f"{server}/#/experiments/{first['experiment_id']}/runs/{first['run_id']}"
    client = MlflowClient(tracking_uri=server)
    run = client.get_run(first["run_id"])
    assert run.info.run_name == "cluster_run"  # named as verl's logger names its run: trainer.experiment_name
    assert client.get_experiment(run.info.experiment_id).name == "cluster_proj"  # trainer.project_name

    # an attempt that restarts from step 1 (no checkpoint yet) logs those steps again: a new run, as locally
    second = verl_main.mlflow_run(_config(ckpt))
    assert second["run_id"] != first["run_id"] and second["experiment_id"] == first["experiment_id"]
    # an attempt that resumes from a checkpoint continues the run the record names
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    assert verl_main.mlflow_run(_config(ckpt))["run_id"] == second["run_id"]
    # a recorded run deleted meanwhile (verl could not attach to it): a new one, recorded
    client.delete_run(second["run_id"])
    third = verl_main.mlflow_run(_config(ckpt))
    assert third["run_id"] not in (first["run_id"], second["run_id"]) and tracking_run.read(ckpt) == third

    # not logging to MLflow, or no server configured: nothing recorded, training goes on
    other = tmp_path / "other"
    assert verl_main.mlflow_run(_config(other, logger=("console", "file"))) is None
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert verl_main.mlflow_run(_config(other)) is None and not (other / tracking_run.FILE).exists()


def test_a_server_that_is_away_costs_a_warning_not_the_run(tmp_path, monkeypatch, caplog):
    from pipeline_steps.training import verl_main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    t = time.monotonic()
    assert verl_main.mlflow_run(_config(tmp_path / "checkpoints")) is None
    assert time.monotonic() - t < 60
    assert "could not start an MLflow run" in caplog.text
    assert not (tmp_path / "checkpoints" / "mlflow_run.json").exists()


RAY_DRIVER = '''
"""What the RayJob's driver does, up to verl's trainer: verl_main's patch, then verl's own run_ppo."""
import os
import sys

import ray
from hydra import compose, initialize_config_module

from pipeline_steps.training import verl_main

verl_main.record_mlflow_run()
from verl.trainer.main_ppo import run_ppo  # noqa: E402  (binds the patched get_ppo_ray_runtime_env)


@ray.remote(num_cpus=0)
class Trainer:
    """Stands in for verl's TaskRunner: verl's own Tracking, created in an actor as verl's trainer creates it."""

    def run(self, config):
        from omegaconf import OmegaConf
        from verl.utils.tracking import Tracking

        print("actor MLFLOW_RUN_ID", os.environ.get("MLFLOW_RUN_ID"), flush=True)  # (MLflow unsets it at end_run)
        tracking = Tracking(
            project_name=config.trainer.project_name,
            experiment_name=config.trainer.experiment_name,
            default_backend=config.trainer.logger,
            config=OmegaConf.to_container(config, resolve=True),
        )
        for step in (1, 2):
            tracking.log({"critic/score/mean": step / 4}, step=step)
        tracking.finish()


with initialize_config_module(config_module="verl.trainer.config", version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=sys.argv[1:])
run_ppo(cfg, Trainer)
'''


@pytest.mark.slow
def test_verls_actor_logs_to_the_recorded_run_through_a_real_ray_job(
    server, server_dir, tmp_path, ray_cluster, monkeypatch
):
    from mlflow.tracking import MlflowClient

    from pipeline_steps import tracking_run
    from pipeline_steps.local import ray_cluster as local_ray

    creds = _login(monkeypatch, server_dir)  # this process's client reads the run back
    driver = tmp_path / "driver.py"
    driver.write_text(RAY_DRIVER)
    ckpt = tmp_path / "run" / "checkpoints"
    overrides = [
        "trainer.logger=[console,mlflow]",
        "trainer.project_name=ray_job_proj",
        "trainer.experiment_name=ray_job_run",
        f"trainer.default_local_dir={ckpt}",
    ]
    sid = f"mlflow-run-{int(time.time())}"
    # the job's runtime env holds MLFLOW_TRACKING_URI, as the RayJob's runtimeEnvYAML does, and (this private test
    # cluster only) the embedded server's login, as the pod's environment holds the team server's
    local_ray.submit_or_attach(
        ray_cluster, sid, [sys.executable, str(driver), *overrides], env={"MLFLOW_TRACKING_URI": server, **creds}
    )
    deadline = time.monotonic() + 300
    while (status := local_ray.info(ray_cluster, sid)["status"]) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, "the Ray job did not finish"
        time.sleep(1)
    logs = local_ray._client(ray_cluster).get_job_logs(sid)
    assert status == "SUCCEEDED", logs[-3000:]

    record = tracking_run.read(ckpt)  # written by the driver
    assert record and record["tracking_uri"] == server
    assert f"actor MLFLOW_RUN_ID {record['run_id']}" in logs, logs[-6000:]  # Ray merged the runtime envs
    client = MlflowClient(tracking_uri=server)
    runs = client.search_runs([record["experiment_id"]])
    assert [r.info.run_id for r in runs] == [record["run_id"]]  # verl attached to it instead of starting its own
    assert runs[0].info.status == "FINISHED" and runs[0].info.run_name == "ray_job_run"
    history = client.get_metric_history(record["run_id"], "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert runs[0].data.params["trainer/project_name"] == "ray_job_proj"  # verl logged its config to the run


def test_the_kuberay_train_task_reads_the_record_into_its_xcom_and_the_report_shows_it(
    k8s_api, server, server_dir, tmp_path, monkeypatch
):
    """The record comes from verl_main's own code run on the config composed from the rendered RayJob's argv and
    env (what the pod runs up to ray.init); the train task reads it from the bucket mount into its XCom."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from mlflow.tracking import MlflowClient
    from verl.trainer import constants_ppo

    from operators.train import GRPOTrainOperator
    from pipeline_steps.training import verl_main
    from pipeline_steps.training.rayjob_manifest import rayjob_name
    from tests.helpers.deferral import deferred, run_trigger
    from tests.helpers.k8s_api_stand_in import SUCCESS
    from tests.helpers.rayjob_operators import read_through_mounts, train_plan

    _login(monkeypatch, server_dir)  # the pod's MLflow client, and this process's reading the run back
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", json.dumps({"conn_type": "http", "host": server}))
    mnt = tmp_path / "mnt"
    monkeypatch.setenv("PIPELINE_MOUNTS", json.dumps([{"uri": "gs://verl-bucket", "claim": "store", "path": str(mnt)}]))
    read_through_mounts(monkeypatch)  # the worker reads the run directory at its mount path (no bucket here)
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", IMAGE)
    run_dir = "gs://verl-bucket/runs/gsm8k/run1"
    k8s_api.script(rayjob_name("t_record", RUN_ID, "train", "train"), SUCCESS)
    with DAG("t_record", schedule=None):
        op = GRPOTrainOperator(
            task_id="train",
            plan=train_plan(  # gsm8k_qwen2_5_3b: trainer.logger has mlflow
                "gsm8k_qwen2_5_3b", "kuberay", "gs://verl-bucket", ["trainer.experiment_name=cluster-xcom"], run_dir
            ),
            namespace="training",
            train_files=["gs://verl-bucket/datasets/gsm8k/train.parquet"],
            model_path="gs://verl-bucket/models/Qwen/Qwen2.5-3B-Instruct/main",
            run_dir=run_dir,
            check_store=False,
            kubernetes_conn_id="k8s_standin",
            poll_interval=0.01,
        )
    trigger = deferred(op, {"run_id": RUN_ID})
    (body,) = k8s_api.creates

    # the pod: its runtime env, its entrypoint's overrides composed by Hydra as main_ppo composes them
    job_env = yaml.safe_load(body["spec"]["runtimeEnvYAML"])["env_vars"]
    argv = shlex.split(body["spec"]["entrypoint"])
    assert argv[:3] == ["python3", "-m", "pipeline_steps.training.verl_main"]
    for k, v in job_env.items():
        monkeypatch.setenv(k, v)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=verl_main.resolve_tool_config(argv[3:]))
    monkeypatch.setattr(constants_ppo, "get_ppo_ray_runtime_env", constants_ppo.get_ppo_ray_runtime_env)
    if "verl.trainer.main_ppo" in sys.modules:  # the patch rebinds its name too; restored after the test
        main_ppo = sys.modules["verl.trainer.main_ppo"]
        monkeypatch.setattr(main_ppo, "get_ppo_ray_runtime_env", main_ppo.get_ppo_ray_runtime_env)
    verl_main.record_mlflow_run()
    runtime_env = constants_ppo.get_ppo_ray_runtime_env(cfg)  # what main_ppo's ray.init gets
    ckpt_pod = Path(str(cfg.trainer.default_local_dir))
    assert ckpt_pod == mnt / "runs/gsm8k/run1/checkpoints"
    recorded = json.loads((ckpt_pod / "mlflow_run.json").read_text())
    assert runtime_env["env_vars"]["MLFLOW_RUN_ID"] == recorded["run_id"]
    assert "MLFLOW_RUN_ID" not in job_env  # so Ray's merge of the two runtime envs has no conflict

    out = op.execute_complete({"run_id": RUN_ID}, run_trigger(trigger, timeout=60))
    assert out["mlflow"] == recorded and out["mlflow"]["tracking_uri"] == server
    run = MlflowClient(tracking_uri=server).get_run(out["mlflow"]["run_id"])
    assert run.info.run_name == "cluster-xcom"
    assert out["tensorboard"] is None  # gsm8k_qwen2_5_3b does not log to tensorboard

    # the report of the cluster run: no train_summary.json, the record beside the checkpoints
    from tests.helpers.step_cli import run_step

    code, summary, err = run_step("report", "--run-dir", str(mnt / "runs/gsm8k/run1"))
    assert code == 0, err[-2000:]
    md = Path(summary["report"]).read_text()
    assert f"| MLflow run | `{recorded['run_id']}` (<{recorded['url']}>) |" in md
