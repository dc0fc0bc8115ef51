"""The Ray pods' egress policy lets them reach what the presets talk to, and nothing else in-cluster (issue 24, 8).

No API server or CNI runs here, so the test evaluates the NetworkPolicy with Kubernetes' egress semantics (a
connection is allowed when some rule's peer matches the destination and its ports match; a rule without ports
allows every port; ipBlock applies to addresses outside the cluster's pod network as the CNI sees them). The MLflow
server's port is ``mlflow server``'s own default, read from the installed mlflow CLI. The old policy refused it.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import yaml

POLICY = Path(__file__).resolve().parents[3] / "k8s" / "components" / "sandbox" / "networkpolicy.yaml"
OWN_NAMESPACE = "verl-pipeline"


def ray_policy() -> dict:
    docs = [d for d in yaml.safe_load_all(POLICY.read_text()) if d]
    return next(d for d in docs if d["metadata"]["name"] == "ray-egress-sandbox-manager")


def _labels_match(selector: dict | None, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in ((selector or {}).get("matchLabels") or {}).items())


def allowed(policy: dict, *, port: int, namespace: str | None = None, labels: dict | None = None, ip: str = "") -> bool:
    """Egress from a selected pod to a pod (namespace, labels) or an outside address (ip), Kubernetes semantics."""
    for rule in policy["spec"].get("egress") or []:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port for p in ports):
            continue
        for peer in rule.get("to") or []:
            if "ipBlock" in peer:
                if namespace is None and ip:
                    addr = ipaddress.ip_address(ip)
                    block = peer["ipBlock"]
                    if addr in ipaddress.ip_network(block["cidr"]) and not any(
                        addr in ipaddress.ip_network(e) for e in block.get("except") or []
                    ):
                        return True
                continue
            if namespace is None:
                continue
            ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
            ns_ok = (
                _labels_match(ns_sel, {"kubernetes.io/metadata.name": namespace})
                if ns_sel is not None
                else namespace == OWN_NAMESPACE
            )
            if ns_ok and (pod_sel is None or _labels_match(pod_sel, labels or {})):
                return True
    return False


def mlflow_server_port() -> int:
    import mlflow.cli

    return next(p for p in mlflow.cli.server.params if p.name == "port").default


def test_ray_pods_reach_an_in_cluster_mlflow_server():
    policy = ray_policy()
    assert allowed(policy, port=mlflow_server_port(), namespace="mlflow", labels={"app": "mlflow"})


def test_the_policy_still_refuses_other_in_cluster_and_vpc_destinations():
    policy = ray_policy()
    assert not allowed(policy, port=5432, namespace="mlflow", labels={"app": "postgresql"})  # MLflow's database
    assert not allowed(policy, port=mlflow_server_port(), namespace="kube-system", labels={})
    assert not allowed(policy, port=443, ip="10.0.3.7") and not allowed(policy, port=443, ip="192.168.1.2")
    assert allowed(policy, port=443, ip="47.96.0.1")  # a public address (OSS, the Hub, Tencent AGS)
    assert allowed(policy, port=7788, namespace="sandbox-system", labels={"component": "sandbox-manager"})
    assert allowed(policy, port=6379, namespace=OWN_NAMESPACE, labels={"ray.io/is-ray-node": "yes"})
