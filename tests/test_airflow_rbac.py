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

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
CHART_NAME = "airflow"  # the chart's Chart.yaml name
# chart/values.yaml defaults: every component creates its own service account
CHART_DEFAULT_CREATE = True


def release() -> tuple[str, str]:
    """Release name and namespace from the install command the values file and README give."""
    text = (K8S / "airflow" / "values.yaml").read_text()
    m = re.search(r"helm upgrade --install (\S+) apache-airflow/airflow -n (\S+)", text)
    assert m, "values.yaml names the helm install command"
    return m.group(1), m.group(2)


def chart_rules() -> dict[str, tuple[str, str]]:
    """component -> (values key, name suffix), parsed from the chart's ``<component>.serviceAccountName`` defines."""
    text = (K8S / "airflow" / "chart-serviceaccount-names.tpl").read_text()
    rules = {}
    for m in re.finditer(r'define "(\w+)\.serviceAccountName"(.*?)\{\{- end \}\}\n\{\{- end \}\}', text, re.S):
        body = m.group(2)
        key = re.search(r"\.Values\.(\w+)\.serviceAccount\.create", body).group(1)
        suffix = re.search(r'printf "%s-([a-z-]+)" \(include "airflow\.fullname" \.\)', body).group(1)
        rules[m.group(1)] = (key, suffix)
    return rules


def fullname(values: dict, release_name: str) -> str:
    """The chart's ``airflow.fullname``."""
    if values.get("fullnameOverride"):
        return values["fullnameOverride"][:63].rstrip("-")
    name = values.get("nameOverride") or CHART_NAME
    return release_name[:63].rstrip("-") if name in release_name else f"{release_name}-{name}"[:63].rstrip("-")


def service_account(component: str) -> str:
    values = yaml.safe_load((K8S / "airflow" / "values.yaml").read_text())
    release_name, _ = release()
    key, suffix = chart_rules()[component]
    sa = ((values.get(key) or {}).get("serviceAccount")) or {}
    if sa.get("create", CHART_DEFAULT_CREATE):
        return sa.get("name") or f"{fullname(values, release_name)}-{suffix}"
    return sa.get("name") or "default"


def components_calling_the_api() -> set[str]:
    """worker when an operator uses the RayJob hook; triggerer when a trigger does (read from the sources)."""
    out = set()
    for path in (ROOT / "operators").rglob("*.py"):
        tree = ast.parse(path.read_text())
        uses_hook = "RayJobHook" in path.read_text()
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
