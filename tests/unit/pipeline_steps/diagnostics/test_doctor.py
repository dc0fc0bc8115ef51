"""``python -m pipeline_steps doctor`` against the Kubernetes API stand-in (tests/helpers/k8s_api_stand_in.py): one run
of a ready cluster, and one run per failing check with the message a user sees. The real ``kubernetes`` client makes the
requests; the stand-in answers CRD, namespace, PVC, Secret, SelfSubjectAccessReview, Deployment and node requests
from the cluster state each test sets (it does not evaluate RBAC objects: the allowed verbs are given directly).
The sandbox, MLflow and store checks: tests/unit/pipeline_steps/diagnostics/test_doctor_services.py."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from pipeline_steps.diagnostics.kuberay import KUBERAY_VERSION
from pipeline_steps.steps.doctor import VERBS
from tests.helpers.doctor_cluster import LINGJUN, NS, SECRET_VALUE, b64
from tests.helpers.k8s_api_stand_in import gpu_node, kuberay_operator
from tests.helpers.step_cli import run_step

ROOT = Path(__file__).resolve().parents[4]


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
        env={
            "PIPELINE_MOUNTS": mounts,
            "KUBERNETES_SERVICE_HOST": "",
            "MLFLOW_TRACKING_URI": "",
            "PIPELINE_STORE_URI": "",
        },
    )
    return rc, summary, err


def test_a_ready_cluster_passes(cluster):
    api, config = cluster
    rc, summary, err = doctor(config)
    assert rc == 0, err
    # CRD, operator, namespace, verbs, PVC, 7 Secret keys, 2 GPU lines, MLflow (no team server: not checked)
    assert summary["ok"] and summary["failed"] == 0 and summary["checks"] == 3 + len(VERBS) + 1 + 7 + 2 + 1
    assert SECRET_VALUE not in err and b64(SECRET_VALUE) not in err and SECRET_VALUE not in json.dumps(summary)
    lines = err.splitlines()
    assert (
        "[ok] KubeRay operator 1.7.x: kuberay-system/kuberay-operator runs 1.7.0 "
        "(image quay.io/kuberay/operator:v1.7.0)" in lines
    )
    assert (
        "[ok] GPU capacity for gsm8k_qwen2_5_3b: 8 nvidia.com/gpu allocatable on 1 matching GPU node(s); "
        "the run needs 1x8 = 8" in lines
    ), err
    assert (  # the preset's Secret mlflow-tracking is optional
        "[ok] MLflow tracking server for gsm8k_qwen2_5_3b: not checked: Secret mlflow-tracking is absent (verl logs "
        "to an SQLite file in the pod, lost with it)" in lines
    ), err


def _fails(config, expect: str, lines: str | None = None) -> str:
    """The run fails naming ``expect`` first; ``lines``: the exact FAIL line and fix a user reads in the checklist."""
    rc, summary, err = doctor(config)
    assert rc == 2 and not summary["ok"], err
    assert expect in summary["error"], summary["error"]
    if lines is not None:
        assert lines in err, err
        assert err.count("[FAIL]") == lines.count("[FAIL]"), err
    return summary["error"]


HELM = (
    f"install/upgrade KubeRay {KUBERAY_VERSION} via helm: helm upgrade --install kuberay-operator "
    f"kuberay/kuberay-operator --version {KUBERAY_VERSION} -n kuberay-system --create-namespace (Helm leaves CRDs as "
    "they are: first kubectl apply --server-side -k "
    f"'github.com/ray-project/kuberay/ray-operator/config/crd?ref=v{KUBERAY_VERSION}')"
)


def test_missing_crd(cluster):
    api, config = cluster
    api.crds.clear()
    assert HELM in _fails(config, "KubeRay RayJob CRD")


def test_missing_crd_seen_by_an_identity_that_may_not_read_crds(cluster):
    """Airflow's accounts may not read cluster-scoped CRDs: doctor lists RayJobs instead (404 without the CRD)."""
    api, config = cluster
    api.access.discard(("apiextensions.k8s.io", "customresourcedefinitions", "", "get", ""))
    rc, summary, err = doctor(config)
    assert rc == 0, err  # CRD installed: the list answers
    api.crds.clear()
    assert HELM in _fails(config, "KubeRay RayJob CRD")


def test_missing_namespace(cluster):
    api, config = cluster
    api.namespaces.discard(NS)
    assert "kubectl apply -k k8s/overlays" in _fails(config, f"namespace {NS}")


def test_a_missing_verb(cluster):
    api, config = cluster
    api.access.discard(("ray.io", "rayjobs", "", "delete", NS))
    assert "rbac.yaml binds airflow-worker and airflow-triggerer" in _fails(config, "may delete rayjobs.ray.io")


def test_unbound_pvc(cluster):
    api, config = cluster
    api.pvcs[(NS, "verl-store")] = "Pending"
    assert "describe pvc verl-store" in _fails(config, "PVC verl-store")


def test_secret_without_its_key(cluster):
    api, config = cluster
    del api.secrets[(NS, "oss-credentials")]["akSecret"]
    error = _fails(config, "Secret oss-credentials key akSecret")
    assert "k8s/secrets/README.md" in error and SECRET_VALUE not in error


def test_an_older_kuberay_operator(cluster):
    api, config = cluster
    api.deployments[:] = [kuberay_operator(version="1.4.2")]
    _fails(
        config,
        "KubeRay operator 1.7.x",
        "[FAIL] KubeRay operator 1.7.x: kuberay-system/kuberay-operator runs 1.4.2 (image "
        "quay.io/kuberay/operator:v1.4.2); the pipeline targets 1.7.0\n"
        f"       fix: {HELM}\n",
    )


def test_the_operator_version_from_the_chart_label_when_the_image_is_mirrored_by_digest(cluster):
    api, config = cluster
    api.deployments[:] = [
        kuberay_operator(version="1.6.0", image="registry.example.com/kuberay/operator@sha256:" + "a" * 64)
    ]
    _fails(
        config,
        "KubeRay operator 1.7.x",
        "[FAIL] KubeRay operator 1.7.x: kuberay-system/kuberay-operator runs 1.6.0 (label "
        "helm.sh/chart=kuberay-operator-1.6.0); the pipeline targets 1.7.0\n",
    )


def test_no_kuberay_operator(cluster):
    api, config = cluster
    api.deployments.clear()
    _fails(
        config,
        "KubeRay operator 1.7.x",
        "[FAIL] KubeRay operator 1.7.x: no Deployment labelled app.kubernetes.io/name=kuberay-operator in any "
        f"namespace\n       fix: {HELM}\n",
    )


def test_too_few_gpus_in_the_pool(cluster):
    """The only 8-GPU node is cordoned; a 4-GPU node is left: short of the 8 the run needs, and no node fits one pod."""
    api, config = cluster
    api.nodes[0] = gpu_node("cn-hangzhou.10.0.0.7", 8, taints=LINGJUN, unschedulable=True)
    api.nodes.append(gpu_node("cn-hangzhou.10.0.0.9", 4, taints=LINGJUN))
    pool = (
        "add GPU nodes the worker pods may use (node_selector {}, tolerations 2: kubectl get nodes -o wide; kubectl "
        "describe node <n>)"
    )
    _fails(
        config,
        "GPU capacity for gsm8k_qwen2_5_3b",
        "[FAIL] GPU capacity for gsm8k_qwen2_5_3b: 4 nvidia.com/gpu allocatable on 1 matching GPU node(s); the run "
        f"needs 1x8 = 8\n       fix: {pool}, or lower trainer.nnodes / trainer.n_gpus_per_node\n"
        "[FAIL] GPUs per node for gsm8k_qwen2_5_3b: largest matching node has 4; nodes with 8: 0, the run needs 1\n"
        "       fix: each worker pod needs 8 GPUs on one node: set trainer.n_gpus_per_node <= 4 (and raise "
        f"trainer.nnodes), or {pool}\n",
    )


def test_enough_gpus_but_none_on_one_node(cluster):
    """Two 4-GPU nodes hold the 8 GPUs, but the worker pod asks for 8 on one node; a node whose taint the preset
    does not tolerate is not counted."""
    api, config = cluster
    api.nodes[0] = gpu_node("cn-hangzhou.10.0.0.7", 4, taints=LINGJUN)
    api.nodes.append(gpu_node("cn-hangzhou.10.0.0.8", 4, taints=LINGJUN))
    api.nodes.append(gpu_node("reserved-8", 8, taints=[{"key": "team", "value": "vision", "effect": "NoSchedule"}]))
    _fails(
        config,
        "GPUs per node for gsm8k_qwen2_5_3b",
        "[FAIL] GPUs per node for gsm8k_qwen2_5_3b: largest matching node has 4; nodes with 8: 0, the run needs 1\n",
    )


def test_checks_the_identity_may_not_make_are_reported_not_failed(cluster):
    """The Airflow roles list neither Deployments in all namespaces nor nodes: the lines say so and pass."""
    api, config = cluster
    api.access -= {("apps", "deployments", "", "list", ""), ("", "nodes", "", "list", "")}
    rc, summary, err = doctor(config)
    assert rc == 0, err
    lines = err.splitlines()
    assert "[ok] KubeRay operator 1.7.x: not checked: this identity may not list Deployments in all namespaces" in lines
    assert "[ok] GPU capacity for gsm8k_qwen2_5_3b: not checked: this identity may not list nodes" in lines


def test_the_targeted_kuberay_version_is_the_vendored_crds_and_the_readmes():
    assert (ROOT / "k8s" / "crds" / f"ray.io_rayjobs.v{KUBERAY_VERSION}.yaml").is_file()
    guide = (ROOT / "docs" / "cluster.md").read_text()
    assert f"kuberay/kuberay-operator --version {KUBERAY_VERSION}" in guide


def test_the_stand_in_answers_like_the_crd_it_serves():
    """The CRD the stand-in describes is named as the vendored KubeRay CRD names itself."""
    crd = yaml.safe_load((ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml").read_text())
    assert crd["metadata"]["name"] == "rayjobs.ray.io" and "v1" in [v["name"] for v in crd["spec"]["versions"]]
