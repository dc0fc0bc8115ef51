"""The Kubernetes API stand-in (tests/helpers/k8s_api_stand_in.py) behind an Airflow connection: the ``k8s_api``
fixture, and the connection id, namespace and vendored KubeRay RayJob CRD it uses.
Registered for every test module by ``pytest_plugins`` in tests/conftest.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
K8S_CONN_ID = "k8s_standin"
K8S_NAMESPACE = "training"
RAYJOB_CRD = ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml"


@pytest.fixture
def k8s_api(tmp_path, monkeypatch):
    """tests/helpers/k8s_api_stand_in.py's API server (RayJobs checked against the vendored KubeRay v1.7.0 CRD),
    reached through the Airflow connection ``k8s_standin`` (namespace ``training``)."""
    from tests.helpers.k8s_api_stand_in import StandIn

    api = StandIn(crd_file=RAYJOB_CRD)
    api.start()
    kube_config = api.kube_config(tmp_path / "kubeconfig", namespace=K8S_NAMESPACE)
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{K8S_CONN_ID.upper()}",
        json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kube_config), "namespace": K8S_NAMESPACE}}
        ),
    )
    try:
        yield api
    finally:
        api.stop()
