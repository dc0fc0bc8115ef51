"""The Kubernetes API stand-in enforces the shipped Roles on every resource, and its Ray dashboard refuses a request
without the cluster's Ray token, as Ray 2.60's token authentication does. With it: ``doctor`` run as the workers'
account (the verl_doctor DAG's) passes on a correct cluster with the shipped RBAC and fails with the old Role (no
PVC read), and the triggerer's log tail reaches the dashboard only with the token."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.helpers.k8s_api_stand_in import StandIn, forbidden_message, request_attributes, shipped_rbac

ROOT = Path(__file__).resolve().parents[3]
NS = "verl-pipeline"
OLD_RBAC = """
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: verl-pipeline-rayjob-operator, namespace: verl-pipeline}
rules:
  - {apiGroups: [ray.io], resources: [rayjobs], verbs: [create, get, list, watch, delete]}
  - {apiGroups: [""], resources: [pods, pods/log], verbs: [get, list]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: verl-pipeline-rayjob-operator, namespace: verl-pipeline}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: verl-pipeline-rayjob-operator}
subjects:
  - {kind: ServiceAccount, name: airflow-worker, namespace: airflow}
  - {kind: ServiceAccount, name: airflow-triggerer, namespace: airflow}
"""


@pytest.fixture
def api():
    stand_in = StandIn(crd_file=ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml")
    stand_in.start()
    try:
        yield stand_in
    finally:
        stand_in.stop()


def core_as(api: StandIn, tmp_path: Path, token: str):
    path = api.kube_config(tmp_path / f"kube-{token[-8:]}", namespace=NS, token=token)
    return config.new_client_from_config(config_file=str(path))


@pytest.mark.parametrize(
    "method, path, query, expected",
    [
        (
            "GET",
            "/api/v1/namespaces/ns/persistentvolumeclaims/c",
            {},
            ("", "persistentvolumeclaims", "", "get", "ns", "c"),
        ),
        ("GET", "/api/v1/namespaces/ns/pods", {"watch": "true"}, ("", "pods", "", "watch", "ns", "")),
        ("GET", "/api/v1/namespaces/ns/pods/p/log", {}, ("", "pods", "log", "get", "ns", "p")),
        ("DELETE", "/apis/ray.io/v1/namespaces/ns/rayjobs/j", {}, ("ray.io", "rayjobs", "", "delete", "ns", "j")),
        ("POST", "/apis/ray.io/v1/namespaces/ns/rayjobs", {}, ("ray.io", "rayjobs", "", "create", "ns", "")),
        ("GET", "/api/v1/namespaces/ns", {}, ("", "namespaces", "", "get", "", "ns")),
        ("GET", "/api/v1/nodes", {}, ("", "nodes", "", "list", "", "")),
        ("GET", "/apis/apps/v1/deployments", {}, ("apps", "deployments", "", "list", "", "")),
        (
            "PATCH",
            "/apis/apps/v1/namespaces/ns/deployments/d/scale",
            {},
            ("apps", "deployments", "scale", "patch", "ns", "d"),
        ),
        ("GET", "/api/jobs/x/logs", {}, None),
    ],
)
def test_request_attributes_as_the_api_servers_resolver(method, path, query, expected):
    assert request_attributes(method, path, query) == expected


def test_the_shipped_roles_are_enforced_on_every_resource(api, tmp_path):
    worker = core_as(api, tmp_path, api.identity("airflow-worker"))
    triggerer = core_as(api, tmp_path, api.identity("airflow-triggerer"))
    api.pvcs[(NS, "verl-store")] = "Bound"
    api.secrets[(NS, "ray-auth-token")] = {"auth_token": base64.b64encode(b"t0k3n").decode()}
    api.secrets[(NS, "oss-credentials")] = {"akId": base64.b64encode(b"x").decode()}
    # the worker reads what doctor checks; nothing else of the core API
    assert client.CoreV1Api(worker).read_namespaced_persistent_volume_claim("verl-store", NS).status.phase == "Bound"
    for call in (
        lambda: client.CoreV1Api(worker).list_namespaced_pod(NS),
        lambda: client.CoreV1Api(worker).read_namespaced_secret("oss-credentials", NS),
        lambda: client.CoreV1Api(worker).list_node(),
        lambda: (
            client.CustomObjectsApi(worker).list_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", watch=False)
            and client.CustomObjectsApi(worker).list_namespaced_custom_object("ray.io", "v1", "default", "rayjobs")
        ),
    ):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 403 and "system:serviceaccount:airflow:airflow-worker" in err.value.body
    # the triggerer: one Secret by name (resourceNames), no other, no list, no create of RayJobs
    token = client.CoreV1Api(triggerer).read_namespaced_secret("ray-auth-token", NS).data["auth_token"]
    assert base64.b64decode(token) == b"t0k3n"
    for call in (
        lambda: client.CoreV1Api(triggerer).read_namespaced_secret("oss-credentials", NS),
        lambda: client.CoreV1Api(triggerer).list_namespaced_secret(NS),
        lambda: client.CoreV1Api(triggerer).read_namespaced_persistent_volume_claim("verl-store", NS),
        lambda: client.CustomObjectsApi(triggerer).create_namespaced_custom_object(
            "ray.io", "v1", NS, "rayjobs", {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j"}}
        ),
    ):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 403
    # a SelfSubjectAccessReview answers from the caller's own grant
    review = client.V1SelfSubjectAccessReview(
        spec=client.V1SelfSubjectAccessReviewSpec(
            resource_attributes=client.V1ResourceAttributes(
                group="ray.io", resource="rayjobs", verb="watch", namespace=NS
            )
        )
    )
    assert client.AuthorizationV1Api(worker).create_self_subject_access_review(review).status.allowed is False
    review.spec.resource_attributes.verb = "create"
    assert client.AuthorizationV1Api(worker).create_self_subject_access_review(review).status.allowed is True


def test_the_forbidden_message_reads_as_the_api_servers():
    message = forbidden_message("", "secrets", "", "get", NS, "s", who="system:serviceaccount:airflow:airflow-worker")
    assert message == (
        'secrets "s" is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot get resource "secrets" '
        'in API group "" in the namespace "verl-pipeline"'
    )


def doctor_as(api: StandIn, tmp_path: Path, token: str):
    from tests.helpers.step_cli import run_step

    path = api.kube_config(tmp_path / "kube-doctor", namespace=NS, token=token)
    mounts = (ROOT / "k8s" / "overlays" / "ack" / "mounts.json").read_text()
    env = {
        "PIPELINE_MOUNTS": mounts,
        "KUBERNETES_SERVICE_HOST": "",
        "MLFLOW_TRACKING_URI": "",
        "PIPELINE_STORE_URI": "",
    }
    return run_step("doctor", "--kube-config", path, "--namespace", NS, env=env)


@pytest.mark.slow  # two doctor runs in a subprocess (~6 s of CPU)
def test_doctor_as_the_workers_account_passes_with_the_shipped_rbac_and_not_with_the_old(api, tmp_path):
    """The issue's fault: the old Role let no one read the PVC doctor checks, so verl_doctor failed on a correct
    cluster; nor did the scheduler's account, which the docs used to suggest, have any grant."""
    api.pvcs[(NS, "verl-store")] = "Bound"
    rc, summary, err = doctor_as(api, tmp_path, api.identity("airflow-worker"))
    assert rc == 0, err
    assert "[ok] PVC verl-store (oss://verl-store): phase Bound" in err
    assert "[ok] KubeRay RayJob CRD: ray.io/v1 rayjobs served" in err  # CRDs are cluster-scoped: the list fallback
    old = [d for d in yaml.safe_load_all(OLD_RBAC) if d]
    rc, summary, err = doctor_as(api, tmp_path, api.identity("airflow-worker", docs=old))
    assert rc == 2 and "[FAIL] PVC verl-store (oss://verl-store): HTTP 403" in err, err
    rc, summary, err = doctor_as(api, tmp_path, api.identity("airflow-scheduler"))
    assert rc == 2 and "[FAIL] may create rayjobs.ray.io in verl-pipeline: denied" in err, err


def rayjob(name: str, secret: str | None = None) -> dict:
    auth = {"mode": "token", **({"secretName": secret} if secret else {})}
    container = {"name": "ray-head", "image": "r.example.com/t@sha256:" + "0" * 64}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name},
        "spec": {
            "entrypoint": "python3 -c 'print(1)'",
            "submissionMode": "HTTPMode",
            "shutdownAfterJobFinishes": True,
            "rayClusterSpec": {
                "authOptions": auth,
                "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [container]}}},
            },
        },
    }


@pytest.mark.parametrize("secret", [None, "ray-auth-token"])
def test_the_dashboard_refuses_a_request_without_the_ray_token(api, tmp_path, secret):
    import urllib.error
    import urllib.request

    admin = config.new_client_from_config(config_file=str(api.kube_config(tmp_path / "admin", namespace=NS)))
    custom = client.CustomObjectsApi(admin)
    api.script("j1", [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "log": ["hello"]}])
    custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", rayjob("j1", secret))
    status = custom.get_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", "j1")["status"]
    url = f"http://{status['dashboardURL']}/api/jobs/{status['jobId']}/logs"
    token = api.ray_token(NS, "j1")
    assert token and (NS, secret or status["rayClusterName"]) in api.secrets

    def get(headers):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    assert get({}) == (401, "Unauthorized: Missing authentication token")
    assert get({"Authorization": "Bearer wrong"}) == (403, "Forbidden: Invalid authentication token")
    assert get({"Authorization": f"Bearer {token}"}) == (200, {"logs": "hello\n"})
    assert get({"X-Ray-Authorization": f"Bearer {token}"})[0] == 200  # Ray's fallback header (proxies, KubeRay)
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", "j1")


def test_the_triggerers_log_tail_carries_the_token_with_the_shipped_rbac(api, tmp_path, monkeypatch):
    """As deployed: the RayJob names the Secret $PIPELINE_RAY_AUTH_SECRET (ray-auth-token), the trigger runs with the
    triggerer's account and reads that Secret, the dashboard gets the token; without the grant the tail is empty."""
    from operators.triggers.kuberay_job import RayJobTrigger

    admin = config.new_client_from_config(config_file=str(api.kube_config(tmp_path / "admin", namespace=NS)))
    api.script("j2", [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "log": ["step 1", "step 2"]}])
    client.CustomObjectsApi(admin).create_namespaced_custom_object(
        "ray.io", "v1", NS, "rayjobs", rayjob("j2", "ray-auth-token")
    )

    def tail(token: str) -> list[str]:
        kube = api.kube_config(tmp_path / f"kube-{token[-6:]}", namespace=NS, token=token)
        extra = {"kube_config_path": str(kube), "namespace": NS}
        monkeypatch.setenv("AIRFLOW_CONN_K8S_RBAC", json.dumps({"conn_type": "kubernetes", "extra": extra}))
        trigger = RayJobTrigger(name="j2", namespace=NS, kubernetes_conn_id="k8s_rbac", submission_mode="HTTPMode")

        async def once():
            poll = await trigger.poll()
            return await trigger.log_tail(poll)

        return asyncio.run(once())

    assert tail(api.identity("airflow-triggerer")) == ["step 1", "step 2"]
    assert api.dashboard_requests[-1] is True
    no_secret = [
        dict(d, rules=[r for r in d["rules"] if "secrets" not in r["resources"]]) if d["kind"] == "Role" else d
        for d in shipped_rbac()
    ]
    assert tail(api.identity("airflow-triggerer", docs=no_secret)) == []  # 403 on the Secret: no tail, no crash
