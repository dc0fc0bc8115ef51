"""The ``cluster`` fixture of the doctor tests: a ready ACK cluster for gsm8k_qwen2_5_3b on the Kubernetes API stand-in
(registered for every test module by ``pytest_plugins`` in tests/conftest.py; a module defining its own ``cluster``
fixture uses its own), with the namespace and secret value it holds."""

from __future__ import annotations

import base64

import pytest

from tests.helpers.k8s_api_stand_in import gpu_node, kuberay_operator

NS = "verl-pipeline"


SECRET_VALUE = "s3cr3t-V4LUE-never-printed"


# a Lingjun GPU node's taints, as the ACK guide's pods tolerate them (the preset's cluster.tolerations)
LINGJUN = [
    {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"},
    {"key": "node-role.alibabacloud.com/lingjun", "value": "", "effect": "NoSchedule"},
]


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def cluster(tmp_path):
    """A ready ACK cluster for gsm8k_qwen2_5_3b: CRD and KubeRay 1.7.0, namespace, every verb, the bucket PVC bound,
    its Secrets, one 8-GPU Lingjun node with the taints the preset tolerates."""
    from pipeline_steps.steps.doctor import VERBS
    from tests.helpers.k8s_api_stand_in import StandIn

    api = StandIn()
    api.start()
    api.pvcs[(NS, "verl-store")] = "Bound"
    api.secrets[(NS, "oss-credentials")] = {"akId": b64(SECRET_VALUE), "akSecret": b64(SECRET_VALUE)}
    api.access = {(g, r, sub, v, NS) for g, r, sub, v in VERBS} | {("", "secrets", "", "get", NS)}
    api.access.add(("apiextensions.k8s.io", "customresourcedefinitions", "", "get", ""))
    api.access |= {("apps", "deployments", "", "list", ""), ("", "nodes", "", "list", "")}
    api.deployments.append(kuberay_operator())
    api.nodes.append(
        gpu_node("cn-hangzhou.10.0.0.7", 8, {"node.kubernetes.io/instance-type": "ml.gu7xf.8xlarge"}, LINGJUN)
    )
    api.nodes.append(gpu_node("cn-hangzhou.10.0.0.2", 0))  # a CPU node: no nvidia.com/gpu
    config = api.kube_config(tmp_path / "kubeconfig", namespace=NS)
    try:
        yield api, config
    finally:
        api.stop()
