"""``python -m pipeline_steps doctor`` against the Kubernetes API stand-in (tests/k8s_api_stand_in.py): one run of a
ready cluster, and one run per failing check with the message a user sees. The real ``kubernetes`` client makes the
requests; the stand-in answers CRD, namespace, PVC, Secret and SelfSubjectAccessReview requests from the cluster
state each test sets (it does not evaluate RBAC objects: the allowed verbs are given directly)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from pipeline_steps.steps.doctor import VERBS
from tests.conftest import run_step

ROOT = Path(__file__).resolve().parents[1]
NS = "verl-pipeline"
SECRET_VALUE = "s3cr3t-V4LUE-never-printed"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def cluster(tmp_path):
    """A ready ACK cluster for gsm8k_qwen2_5_3b: CRD, namespace, every verb, the bucket PVC bound, its Secrets."""
    from tests.k8s_api_stand_in import StandIn

    api = StandIn()
    api.start()
    api.pvcs[(NS, "verl-store")] = "Bound"
    api.secrets[(NS, "oss-credentials")] = {"akId": b64(SECRET_VALUE), "akSecret": b64(SECRET_VALUE)}
    api.access = {(g, r, sub, v, NS) for g, r, sub, v in VERBS} | {("", "secrets", "", "get", NS)}
    api.access.add(("apiextensions.k8s.io", "customresourcedefinitions", "", "get", ""))
    config = api.kube_config(tmp_path / "kubeconfig", namespace=NS)
    try:
        yield api, config
    finally:
        api.stop()


def doctor(config: Path):
    mounts = (ROOT / "k8s" / "overlays" / "ack" / "mounts.json").read_text()
    rc, summary, err = run_step(
        "doctor",
        "--kube-config",
        config,
        "--namespace",
        NS,
        "--experiment",
        "gsm8k_qwen2_5_3b",
        env={"PIPELINE_MOUNTS": mounts, "KUBERNETES_SERVICE_HOST": ""},
    )
    return rc, summary, err


def test_a_ready_cluster_passes(cluster):
    api, config = cluster
    rc, summary, err = doctor(config)
    assert rc == 0, err
    assert (
        summary["ok"] and summary["failed"] == 0 and summary["checks"] == 2 + len(VERBS) + 1 + 7
    )  # CRD, namespace, verbs, PVC, 7 Secret keys
    assert SECRET_VALUE not in err and b64(SECRET_VALUE) not in err and SECRET_VALUE not in json.dumps(summary)


def _fails(config, expect: str) -> str:
    rc, summary, err = doctor(config)
    assert rc == 2 and not summary["ok"], err
    assert expect in summary["error"], summary["error"]
    return summary["error"]


def test_missing_crd(cluster):
    api, config = cluster
    api.crds.clear()
    assert "install the KubeRay operator" in _fails(config, "KubeRay RayJob CRD")


def test_missing_crd_seen_by_an_identity_that_may_not_read_crds(cluster):
    """Airflow's accounts may not read cluster-scoped CRDs: doctor lists RayJobs instead (404 without the CRD)."""
    api, config = cluster
    api.access.discard(("apiextensions.k8s.io", "customresourcedefinitions", "", "get", ""))
    rc, summary, err = doctor(config)
    assert rc == 0, err  # CRD installed: the list answers
    api.crds.clear()
    assert "install the KubeRay operator" in _fails(config, "KubeRay RayJob CRD")


def test_missing_namespace(cluster):
    api, config = cluster
    api.namespaces.discard(NS)
    assert "kubectl apply -k k8s/overlays" in _fails(config, f"namespace {NS}")


def test_a_missing_verb(cluster):
    api, config = cluster
    api.access.discard(("ray.io", "rayjobs", "", "watch", NS))
    assert "rbac.yaml binds airflow-worker and airflow-triggerer" in _fails(config, "may watch rayjobs.ray.io")


def test_unbound_pvc(cluster):
    api, config = cluster
    api.pvcs[(NS, "verl-store")] = "Pending"
    assert "describe pvc verl-store" in _fails(config, "PVC verl-store")


def test_secret_without_its_key(cluster):
    api, config = cluster
    del api.secrets[(NS, "oss-credentials")]["akSecret"]
    error = _fails(config, "Secret oss-credentials key akSecret")
    assert "k8s/secrets/README.md" in error and SECRET_VALUE not in error


def test_the_stand_in_answers_like_the_crd_it_serves():
    """The CRD the stand-in describes is named as the vendored KubeRay CRD names itself."""
    crd = yaml.safe_load((ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml").read_text())
    assert crd["metadata"]["name"] == "rayjobs.ray.io" and "v1" in [v["name"] for v in crd["spec"]["versions"]]
