"""Step ``doctor``: what first contact with a cluster needs, checked before a GPU is requested.

Against the Kubernetes API the pipeline will use (the kube config, or in-cluster credentials inside a pod), it checks:
the KubeRay RayJob CRD (and that it serves ``ray.io/v1``) and the operator's version; the namespace; a
``SelfSubjectAccessReview`` for every verb the worker's code uses (run it as the worker's service account, which the
verl_doctor DAG does; the scheduler's account is bound to nothing); each PVC of ``$PIPELINE_MOUNTS`` is Bound; each
Secret the preset's pods read exists with the expected key. With a preset it also checks allocatable GPUs against the
run's request, and asks the sandbox service (tool-agent presets) and the MLflow server (``trainer.logger`` with
mlflow) one authenticated question each; with a store URI, it lists the store with the connection's credentials
(``pipeline_steps/diagnostics/``). A secret value is only ever sent in a request header, never printed. It writes one
line per check to stderr (``[ok]`` / ``[FAIL]`` with the fix: the Airflow task log shows stderr) and exits 2 when any
fails.
"""

from __future__ import annotations

import logging
import os
import sys

from pipeline_steps import settings
from pipeline_steps.diagnostics import Check
from pipeline_steps.diagnostics.kuberay import install_fix
from pipeline_steps.errors import UserError

log = logging.getLogger(__name__)

CRD = "rayjobs.ray.io"
# What the worker's code calls (the operators through operators/hooks/rayjob_api.py, and this step's PVC check), as
# k8s/base/rbac.yaml's worker Role grants it (tests/unit/k8s/test_rbac_grants.py keeps the three in step); the
# triggerer's Role is a subset for RayJobs (get, delete) plus its Ray token Secret
VERBS = [("ray.io", "rayjobs", "", v) for v in ("create", "get", "list", "delete")] + [
    ("", "persistentvolumeclaims", "", "get"),
]


def add_arguments(p):
    p.add_argument("--namespace", default="verl-pipeline", help="namespace the RayJobs run in")
    p.add_argument("--experiment", default=None, help="a cluster preset: its Secrets, GPUs, sandbox and MLflow servers")
    p.add_argument(
        "--store-uri",
        default=settings.get(settings.STORE_URI) or "",
        help="store root to list with the connection's credentials (default $PIPELINE_STORE_URI)",
    )
    p.add_argument("--kube-config", default=None, help="kube config file (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--context", default=None, help="kube config context")


def _clients(args):
    from kubernetes import client, config

    try:
        if args.kube_config or args.context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            api = config.new_client_from_config(config_file=args.kube_config, context=args.context)
        else:
            config.load_incluster_config()
            api = client.ApiClient()
    except Exception as exc:  # noqa: BLE001 - no kube config is the user's to fix
        raise UserError(f"no Kubernetes credentials: {str(exc).splitlines()[0]}") from None
    return client.CoreV1Api(api), client.ApiextensionsV1Api(api), client.AuthorizationV1Api(api), client, api


def _status(exc) -> int | None:
    return getattr(exc, "status", None)


def check_crd(ext, custom, ns: str) -> Check:
    from kubernetes.client.exceptions import ApiException

    fix = install_fix()
    try:
        crd = ext.read_custom_resource_definition(CRD)
    except ApiException as exc:
        if _status(exc) != 403:
            return Check("KubeRay RayJob CRD", False, f"HTTP {_status(exc)} reading {CRD}", fix)
        # Airflow's accounts may not read CRDs (cluster-scoped): listing RayJobs answers 404 when ray.io/v1 is absent
        try:
            custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs", limit=1)
        except ApiException as exc2:
            if _status(exc2) == 404:
                return Check("KubeRay RayJob CRD", False, "ray.io/v1 rayjobs not served", fix)
            return Check("KubeRay RayJob CRD", True, f"not checked: HTTP {_status(exc2)} listing rayjobs")
        return Check("KubeRay RayJob CRD", True, "ray.io/v1 rayjobs served")
    served = [v.name for v in crd.spec.versions if v.served]
    if "v1" not in served:
        return Check("KubeRay RayJob CRD", False, f"{CRD} serves {served}, not v1", fix)
    return Check("KubeRay RayJob CRD", True, f"{CRD} serves v1")


def check_namespace(core, ns: str) -> Check:
    from kubernetes.client.exceptions import ApiException

    try:
        core.read_namespace(ns)
    except ApiException as exc:
        if _status(exc) == 403:  # namespaces are cluster-scoped; the RBAC checks below fail if it is missing
            return Check(f"namespace {ns}", True, "not checked: this identity may not read namespaces")
        fix = "kubectl apply -k k8s/overlays/<ack|gke> (creates the namespace, RBAC, PVC and the Ray service account)"
        return Check(f"namespace {ns}", False, f"HTTP {_status(exc)}", fix)
    return Check(f"namespace {ns}", True)


def check_access(authz, client, ns: str) -> list[Check]:
    out = []
    for group, resource, sub, verb in VERBS:
        what = f"{verb} {resource}{'/' + sub if sub else ''}{'.' + group if group else ''}"
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=client.V1ResourceAttributes(
                    group=group, resource=resource, subresource=sub or None, verb=verb, namespace=ns
                )
            )
        )
        status = authz.create_self_subject_access_review(review).status
        fix = (
            "kubectl apply -k k8s/overlays/<cloud>: k8s/base/rbac.yaml binds airflow-worker and airflow-triggerer; "
            "run doctor as the worker's service account (the verl_doctor DAG)"
        )
        out.append(Check(f"may {what} in {ns}", bool(status.allowed), "" if status.allowed else "denied", fix))
    return out


def check_pvcs(core, ns: str) -> list[Check]:
    from kubernetes.client.exceptions import ApiException

    from pipeline_steps.training.mounts import MountMap

    out = []
    for m in MountMap.from_env().mounts:
        name = f"PVC {m.claim} ({m.uri})"
        try:
            phase = core.read_namespaced_persistent_volume_claim(m.claim, ns).status.phase
        except ApiException as exc:
            out.append(Check(name, False, f"HTTP {_status(exc)}", "kubectl apply -k k8s/overlays/<cloud> (pv-pvc-*)"))
            continue
        fix = f"kubectl -n {ns} describe pvc {m.claim}: check the PV's bucket, CSI driver and credentials"
        out.append(Check(name, phase == "Bound", f"phase {phase}", fix))
    return out


def check_secrets(core, ns: str, exp) -> list[Check]:
    from kubernetes.client.exceptions import ApiException

    out = []
    for s in (exp.spec.get("cluster") or {}).get("secrets") or []:
        name = f"Secret {s['secret']} key {s['key']}" + (" (optional)" if s.get("optional") else "")
        fix = f"create it: k8s/secrets/README.md (kubectl -n {ns} create secret generic {s['secret']} ...)"
        try:
            secret = core.read_namespaced_secret(s["secret"], ns)
        except ApiException as exc:
            if _status(exc) == 404 and s.get("optional"):
                out.append(Check(name, True, "absent (optional)"))
            elif _status(exc) == 403:
                out.append(Check(name, True, "not checked: this identity may not read Secrets (by design)"))
            else:
                out.append(Check(name, False, f"HTTP {_status(exc)}", fix))
            continue
        keys = set((secret.data or {}).keys())  # names only; the values are never looked at
        missing = s["key"] not in keys
        out.append(Check(name, not missing, f"has keys {sorted(keys)}" if missing else "", fix))
    return out


def run(args):
    from pipeline_steps.diagnostics import gpus, kuberay, services

    core, ext, authz, client, api = _clients(args)
    custom = client.CustomObjectsApi(api)
    checks = [check_crd(ext, custom, args.namespace), kuberay.check_operator_version(client.AppsV1Api(api))]
    checks.append(check_namespace(core, args.namespace))
    checks += check_access(authz, client, args.namespace)
    checks += check_pvcs(core, args.namespace)
    if args.experiment:
        from pipeline_steps.training import experiment as experiments

        exp = experiments.load(args.experiment)
        checks += check_secrets(core, args.namespace, exp)
        checks += gpus.check_gpus(core, exp)
        checks += services.check_sandbox(core, args.namespace, exp)
        checks += services.check_mlflow(core, args.namespace, exp)
    checks += services.check_store(args.store_uri)
    for c in checks:
        sys.stderr.write(c.line() + "\n")
    sys.stderr.flush()
    failed = [c for c in checks if not c.ok]
    if failed:
        raise UserError(f"{len(failed)} of {len(checks)} checks failed; first: {failed[0].name}: {failed[0].fix}")
    return {"checks": len(checks), "failed": 0}
