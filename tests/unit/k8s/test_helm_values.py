"""The Helm values as the official chart (pinned) reads them: versions pinned, optional Secrets cannot block the
install, the MLflow connection injected as k8s/secrets/README.md says, task logs written to the bucket."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
AIRFLOW = ROOT / "k8s" / "airflow"
CHART = "1.22.0"  # apache-airflow/airflow chart release the values are written against (its values.schema.json)
# scheme, and the provider module Airflow's logging settings load for it (the image's build imports it)
CLOUDS = {
    "ack": ("oss://", "airflow.providers.alibaba.cloud.log.oss_task_handler"),
    "gke": ("gs://", "airflow.providers.google.cloud.log.gcs_task_handler"),
}


def values(name: str = "values.yaml") -> dict:
    return yaml.safe_load((AIRFLOW / name).read_text())


def extra_env() -> list[dict]:
    return yaml.safe_load(values().get("extraEnv") or "[]")


def test_chart_and_airflow_versions_are_pinned():
    airflow = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))[
        "apache-airflow"
    ]
    v = values()
    assert v["airflowVersion"] == airflow and v["defaultAirflowTag"] == airflow
    for text in ((AIRFLOW / "values.yaml").read_text(), (ROOT / "docs" / "cluster.md").read_text()):
        commands = re.findall(r"helm upgrade --install airflow apache-airflow/airflow[^\n]*", text)
        assert commands
        for command in commands:
            assert f"--version {CHART}" in command, command
            assert "-f k8s/airflow/values.yaml -f k8s/airflow/values-" in command, command


def test_only_the_store_connection_is_a_required_secret():
    """A `secret:` entry is a secretKeyRef without `optional`: its Secret missing stops every pod."""
    assert [s["envName"] for s in values()["secret"]] == ["AIRFLOW_CONN_PIPELINE_STORE"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in extra_env()}
    assert refs["HF_TOKEN"] == {"name": "hf-token", "key": "token", "optional": True}
    for name, ref in refs.items():
        assert ref.get("optional") is True, f"{name}: an optional Secret must not block the install"


def test_the_mlflow_connection_is_injected_as_the_secrets_readme_says():
    ref = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in extra_env()}["AIRFLOW_CONN_MLFLOW_DEFAULT"]
    readme = (ROOT / "k8s" / "secrets" / "README.md").read_text()
    rows = [line for line in readme.splitlines() if f"`{ref['key']}`" in line]
    row = next(line for line in rows if "AIRFLOW_CONN_MLFLOW_DEFAULT" in line)
    assert row.startswith(f"| `{ref['name']}` (`airflow`)")
    from pipeline_steps import settings

    assert settings.get(settings.MLFLOW_CONN_ID) == "mlflow_default"  # the connection id the operators read


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_task_logs_go_to_the_deployments_bucket(cloud):
    scheme, provider = CLOUDS[cloud]
    logging = values(f"values-{cloud}.yaml")["config"]["logging"]
    assert logging["remote_logging"] == "True" and logging["remote_base_log_folder"].startswith(scheme)
    mounts = json.loads((ROOT / "k8s" / "overlays" / cloud / "mounts.json").read_text())
    bucket = mounts[0]["uri"]
    assert logging["remote_base_log_folder"].startswith(bucket + "/"), "the deployment's own bucket"
    from pipeline_steps import settings

    assert logging["remote_log_conn_id"] == settings.get(settings.STORE_CONN_ID) == "pipeline_store"
    assert set(values(f"values-{cloud}.yaml")) == {"config"}  # maps merge over values.yaml; no list is replaced
    assert provider in (ROOT / "k8s" / "docker" / "Dockerfile.airflow").read_text()


def test_the_kubernetes_executor_deletes_pods_so_logs_must_be_remote():
    v = values()
    assert v["executor"] == "KubernetesExecutor" and v["config"]["kubernetes_executor"]["delete_worker_pods"] == "True"
    assert "logging" not in v["config"]  # each cloud's file sets it (a folder without its provider fails at start)
