"""The official Airflow Helm chart's service-account names for our values (its naming rules, vendored verbatim as
k8s/airflow/chart-serviceaccount-names.tpl, evaluated with the values we ship and the README's release name): what the
RBAC tests and the Kubernetes API stand-in bind the shipped Roles to."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
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
