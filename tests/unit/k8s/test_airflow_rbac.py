"""Every Airflow component that calls the Kubernetes API is bound by k8s/base/rbac.yaml (issue 24, fault 2).

The service-account names are the official Airflow Helm chart's: its own naming rules (``_helpers.yaml``, vendored
verbatim as k8s/airflow/chart-serviceaccount-names.tpl) evaluated with the values we ship and the README's release
name. Which components call the API is read from the code: operators run in worker pods, triggers (``BaseTrigger``
subclasses that use the RayJob hook) run in the triggerer. The old rbac.yaml bound only the worker and fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from tests.helpers.helm_accounts import chart_rules, release, service_account

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"


def components_calling_the_api() -> set[str]:
    """worker when an operator uses the RayJob hook (itself or through ``operators.backends.KubeRayJobs``);
    triggerer when a trigger does (read from the sources)."""
    out = set()
    for path in (ROOT / "operators").rglob("*.py"):
        tree = ast.parse(path.read_text())
        uses_hook = any(name in path.read_text() for name in ("RayJobHook", "KubeRayJobs"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and uses_hook:
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if bases & {"JobPollTrigger", "BaseTrigger"}:
                    out.add("triggerer")
                if any(b.endswith("Operator") for b in bases):
                    out.add("worker")
    return out


def bound_subjects() -> set[tuple[str, str]]:
    docs = list(yaml.safe_load_all((K8S / "base" / "rbac.yaml").read_text()))
    out = set()
    for d in docs:
        if d and d["kind"] == "RoleBinding":
            out |= {(s["namespace"], s["name"]) for s in d["subjects"] if s["kind"] == "ServiceAccount"}
    return out


def test_chart_rules_parse():
    rules = chart_rules()
    assert rules["worker"] == ("workers", "worker") and rules["triggerer"] == ("triggerer", "triggerer")


def test_every_component_calling_the_api_is_bound():
    components = components_calling_the_api()
    assert components == {"worker", "triggerer"}
    _, namespace = release()
    subjects = bound_subjects()
    for component in sorted(components):
        sa = service_account(component)
        assert (namespace, sa) in subjects, f"{component}: service account {namespace}/{sa} is not in rbac.yaml"


def test_every_airflow_account_reading_the_bucket_on_gke_is_granted():
    """Worker and triggerer both read the store (the triggerer: metrics of a deferred run); on GKE each needs IAM."""
    text = (K8S / "overlays" / "gke" / "ray-serviceaccount.yaml").read_text()
    _, namespace = release()
    m = re.search(r"for sa in ([a-z0-9 -]+); do .*?subject/ns/(\S+?)/sa/\$sa", text, re.S)
    assert m, "the GKE overlay gives the command that grants Airflow's accounts the bucket"
    assert m.group(2) == namespace
    assert {service_account("worker"), service_account("triggerer")} <= set(m.group(1).split())


# -- the operator and the trigger with those accounts' permissions only ---------------------------------------------


def grants(rbac_docs: list[dict], account: str, namespace: str, as_namespace: str) -> set[tuple]:
    """What ``account`` (in ``namespace``) may do, from Role/RoleBinding documents, as the stand-in's grant set in
    ``as_namespace`` (the test's namespace stands for verl-pipeline): the stand-in's own RBAC model."""
    from tests.helpers.k8s_api_stand_in import rbac_grants

    return rbac_grants(rbac_docs, account, namespace, as_namespace)


def _run_as_components(api, tmp_path, monkeypatch, rbac_docs) -> dict:
    """execute() with the worker's grant, then the trigger with the triggerer's: the trigger's event."""
    import json as _json

    from tests.helpers.deferral import deferred, run_trigger
    from tests.helpers.k8s_connection import K8S_CONN_ID, K8S_NAMESPACE
    from tests.helpers.rayjob_operators import CONTEXT, kuberay_deployment, make_op

    _, airflow_ns = release()
    configs = {}
    for component in ("worker", "triggerer"):
        token = f"{component}-{id(rbac_docs)}"
        api.identities[token] = grants(rbac_docs, service_account(component), airflow_ns, K8S_NAMESPACE)
        configs[component] = api.kube_config(tmp_path / f"kube-{component}", namespace=K8S_NAMESPACE, token=token)

    def use(component):  # the same connection id, the pod's own credentials (in-cluster in production)
        extra = {"kube_config_path": str(configs[component]), "namespace": K8S_NAMESPACE}
        monkeypatch.setenv(
            f"AIRFLOW_CONN_{K8S_CONN_ID.upper()}", _json.dumps({"conn_type": "kubernetes", "extra": extra})
        )

    kuberay_deployment(monkeypatch, tmp_path)
    use("worker")
    trigger = deferred(make_op("grpo_rbac"), CONTEXT)
    use("triggerer")
    return run_trigger(trigger)


def test_operator_and_trigger_work_with_the_bound_accounts_only(k8s_api, tmp_path, monkeypatch):
    docs = list(yaml.safe_load_all((K8S / "base" / "rbac.yaml").read_text()))
    event = _run_as_components(k8s_api, tmp_path, monkeypatch, docs)
    assert event["status"] == "success", event


def test_a_missing_subject_or_verb_fails_the_deferred_task(k8s_api, tmp_path, monkeypatch):
    """The old binding (worker only), and a Role without ``get`` on rayjobs: the trigger's polls get 403."""
    docs = list(yaml.safe_load_all((K8S / "base" / "rbac.yaml").read_text()))
    worker_only = [dict(d) for d in docs]
    for d in worker_only:
        if d["kind"] == "RoleBinding":
            d["subjects"] = [s for s in d["subjects"] if s["name"] == service_account("worker")]
    event = _run_as_components(k8s_api, tmp_path, monkeypatch, worker_only)
    assert event["status"] == "error" and "403" in event["message"], event
    no_get = [dict(d) for d in docs]
    for d in no_get:
        if d["kind"] == "Role":
            d["rules"] = [dict(r, verbs=[v for v in r["verbs"] if v != "get"]) for r in d["rules"]]
    event = _run_as_components(k8s_api, tmp_path, monkeypatch, no_get)
    assert event["status"] == "error" and "403" in event["message"], event
