"""``verl_doctor``: the DAG file parses fast, its form's schema holds, and its task runs the real step through the
project's step operator against the Kubernetes API stand-in: a failing check fails the task (no retry) with the
checklist in the task log."""

from __future__ import annotations

import logging
import runpy
import subprocess
import sys

import pytest

from tests.helpers.doctor_cluster import NS
from tests.helpers.k8s_api_stand_in import kuberay_operator
from tests.helpers.step_cli import ROOT

DAG_FILE = ROOT / "dags" / "verl_doctor.py"
HEAVY = {"torch", "ray", "verl", "pandas", "datasets", "transformers", "vllm", "pyarrow", "kubernetes", "mlflow"}


def test_parses_fast_without_heavy_imports():
    code = f"""
import runpy, sys, time
import airflow.sdk  # the scheduler has it loaded already
before = set(sys.modules)
t = time.process_time()
runpy.run_path({str(DAG_FILE)!r})
print(time.process_time() - t, ",".join(sorted({{m.split('.')[0] for m in set(sys.modules) - before}})))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "AIRFLOW__CORE__LOAD_EXAMPLES": "False"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, modules = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert not HEAVY & set(modules.split(",")), modules
    assert float(seconds) < 1.0, f"DAG parse took {seconds}s"


@pytest.fixture(scope="module")
def dag():
    return runpy.run_path(str(DAG_FILE))["dag"]


def test_manual_trigger_and_form(dag):
    from airflow.sdk.definitions.param import ParamsDict

    assert dag.dag_id == "verl_doctor" and dag.schedule is None and dag.task_ids == ["doctor"]
    assert dag.task_dict["doctor"].retries == 0
    params = ParamsDict(dag.params)
    assert params["namespace"] == "verl-pipeline" and params["experiment"] == "gsm8k_qwen2_5_3b"
    for bad in ({"namespace": "Verl_Pipeline"}, {"experiment": "no_such_preset"}, {"store_uri": "s3://x"}):
        p = ParamsDict(dag.params)
        with pytest.raises(Exception):  # ParamValidationError: the form refuses it before a run starts
            p.update(bad)
            p.validate()


def test_a_failing_check_fails_the_task_with_the_checklist_in_its_log(dag, cluster, monkeypatch, caplog):  # noqa: F811
    from airflow.sdk.exceptions import AirflowFailException

    api, config = cluster
    api.deployments[:] = [kuberay_operator(version="1.5.1")]
    monkeypatch.setenv("KUBECONFIG", str(config))  # the step's default client config, as a pod's would be in-cluster
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "")
    monkeypatch.setenv("PIPELINE_MOUNTS", (ROOT / "k8s" / "overlays" / "ack" / "mounts.json").read_text())
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    task = dag.task_dict["doctor"]
    task.render_template_fields(
        {"params": {"experiment": "gsm8k_qwen2_5_3b", "namespace": NS, "store_uri": None}},
        jinja_env=dag.get_template_env(),
    )
    assert task.request["args"] == ["--namespace", NS, "--experiment", "gsm8k_qwen2_5_3b", "--store-uri", ""]
    logger = logging.getLogger("verl_doctor.test")
    monkeypatch.setattr(type(task), "log", property(lambda self: logger))  # the task log, as caplog records
    with caplog.at_level(logging.INFO, logger="verl_doctor.test"), pytest.raises(AirflowFailException) as failed:
        task.execute({"ti": None})
    assert str(failed.value).startswith("step doctor: 1 of 19 checks failed; first: KubeRay operator 1.7.x: ")
    log = [r.getMessage() for r in caplog.records]
    assert "[ok] KubeRay RayJob CRD: rayjobs.ray.io serves v1" in log
    assert (
        "[FAIL] KubeRay operator 1.7.x: kuberay-system/kuberay-operator runs 1.5.1 (image "
        "quay.io/kuberay/operator:v1.5.1); the pipeline targets 1.7.0" in log
    )
    assert any(line.startswith("       fix: install/upgrade KubeRay 1.7.0 via helm") for line in log), log
