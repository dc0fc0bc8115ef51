"""The KubeRay operator's version, read from its Deployment (the Helm chart's labels and image tag)."""

from __future__ import annotations

import re

from pipeline_steps.diagnostics import Check

# The KubeRay release the pipeline is built and tested against: the vendored RayJob CRD (k8s/crds), docs/cluster.md's
# install step and the stand-in's controller messages (tests/unit/pipeline_steps/diagnostics/test_doctor.py checks they
# agree).
KUBERAY_VERSION = "1.7.0"
SELECTOR = "app.kubernetes.io/name=kuberay-operator"  # the kuberay-operator chart's name label
_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


def install_fix(namespace: str = "kuberay-system") -> str:
    return (
        f"install/upgrade KubeRay {KUBERAY_VERSION} via helm: helm upgrade --install kuberay-operator "
        f"kuberay/kuberay-operator --version {KUBERAY_VERSION} -n {namespace} --create-namespace (Helm leaves CRDs "
        f"as they are: first kubectl apply --server-side -k "
        f"'github.com/ray-project/kuberay/ray-operator/config/crd?ref=v{KUBERAY_VERSION}')"
    )


def _version(dep) -> tuple[str, str]:
    """(version, where it was read) of a kuberay-operator Deployment; ("", image) when nothing names one.

    The image tag is what runs; a mirrored or digest-pinned image falls back to the chart's labels."""
    containers = dep.spec.template.spec.containers or []
    image = next(
        (c.image for c in containers if "operator" in (c.image or "")), containers[0].image if containers else ""
    )
    tag = image.rsplit("@", 1)[0].rpartition(":")[2] if ":" in image.rsplit("/", 1)[-1] else ""
    labels = dep.metadata.labels or {}
    chart = labels.get("helm.sh/chart", "")
    for value, where in (
        (tag, f"image {image}"),
        (chart.removeprefix("kuberay-operator-"), f"label helm.sh/chart={chart}"),
        (labels.get("app.kubernetes.io/version", ""), "label app.kubernetes.io/version"),
    ):
        m = _VERSION.match(value or "")
        if m:
            return ".".join(m.groups()), where
    return "", f"image {image}"


def check_operator_version(apps) -> Check:
    from kubernetes.client.exceptions import ApiException

    name = f"KubeRay operator {KUBERAY_VERSION.rsplit('.', 1)[0]}.x"
    try:
        deployments = apps.list_deployment_for_all_namespaces(label_selector=SELECTOR).items
    except ApiException as exc:
        if exc.status == 403:  # a cluster-wide list is not in the Airflow roles (k8s/base/rbac.yaml)
            return Check(name, True, "not checked: this identity may not list Deployments in all namespaces")
        return Check(name, False, f"HTTP {exc.status} listing Deployments", install_fix())
    if not deployments:
        return Check(name, False, f"no Deployment labelled {SELECTOR} in any namespace", install_fix())
    want = KUBERAY_VERSION.split(".")[:2]
    for dep in deployments:
        where = f"{dep.metadata.namespace}/{dep.metadata.name}"
        version, source = _version(dep)
        if not version:
            return Check(name, True, f"{where}: no version in {source}; make sure it is KubeRay {KUBERAY_VERSION}")
        if version.split(".")[:2] != want:
            detail = f"{where} runs {version} ({source}); the pipeline targets {KUBERAY_VERSION}"
            return Check(name, False, detail, install_fix(dep.metadata.namespace))
    dep = deployments[0]
    version, source = _version(dep)
    return Check(name, True, f"{dep.metadata.namespace}/{dep.metadata.name} runs {version} ({source})")
