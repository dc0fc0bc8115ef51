"""A small in-process stand-in for the Kubernetes API server, for RayJob tests.

No Kubernetes API server can run on this machine, so the operator's REAL clients
(the cncf-kubernetes ``KubernetesHook``, which uses the ``kubernetes`` package, and
``kubernetes_asyncio`` in the trigger) talk HTTP to this server through an ordinary
kube config whose ``server`` is ``http://127.0.0.1:PORT``.

What it serves (the same paths, verbs, status codes and ``Status`` bodies as a real
API server, so the clients' own error handling runs):

- ``/apis/ray.io/v1/namespaces/{ns}/rayjobs``: POST (create; 409 ``AlreadyExists`` on a
  duplicate name; 422 ``Invalid`` when the body fails the RayJob CRD's openAPIV3Schema,
  if the schema file is given), GET (list, with an equality ``labelSelector``).
- ``/apis/ray.io/v1/namespaces/{ns}/rayjobs/{name}``: GET, DELETE (404 ``NotFound``).
- ``/api/v1/namespaces/{ns}/pods?labelSelector=`` and ``.../pods/{name}/log?tailLines=``:
  the KubeRay submitter pod (``K8sJobMode``), whose log is the Ray job's log.
- for ``doctor``: the RayJob CRD, namespaces, PVCs, Secrets (from ``crds``, ``namespaces``, ``pvcs``, ``secrets``),
  ``SelfSubjectAccessReview`` (from ``access``), Deployments in all namespaces (``/apis/apps/v1/deployments``, with an
  equality ``labelSelector``: the KubeRay operator's, from :func:`kuberay_operator`) and nodes (``/api/v1/nodes``,
  from :func:`gpu_node`), both lists refused with 403 outside ``access`` as cluster-scoped requests.
- ``/api/jobs/{job_id}/logs``: the Ray dashboard's Jobs REST API (``HTTPMode`` has no submitter
  pod); ``status.dashboardURL`` points at this server. As Ray 2.60's dashboard does with token authentication on
  (``ray/_private/authentication/http_token_authentication.py``), it answers 401 to a request without the cluster's
  token (``Authorization: Bearer <token>``, or ``X-Ray-Authorization``) and 403 to a wrong one, for every RayJob whose
  ``spec.rayClusterSpec.authOptions.mode`` is ``token``; the token lives in the Secret KubeRay gives the cluster
  (``authOptions.secretName``, else one named after the RayCluster, key ``auth_token``), created when the cluster
  starts (a named Secret the test did not create is created too, with a random token).

RBAC: a bearer token in ``identities`` carries a grant set, normally computed from the shipped Role and RoleBinding
objects (:func:`rbac_grants`, :meth:`StandIn.identity`, :func:`shipped_rbac`: k8s/base/rbac.yaml); every Kubernetes API
request with it (any resource, namespaced or cluster-scoped, subresources, ``resourceNames``) is decided by the grant as
the API server's RBAC authorizer decides it, 403 ``Forbidden`` outside it, and its ``SelfSubjectAccessReview`` answers
from it (creating one needs no grant: Kubernetes' ``system:basic-user`` allows it to everyone). This server's own token
(the tests' administrator) may do everything, except what ``access`` leaves out of the cluster state ``doctor`` reads.

A scripted controller plays KubeRay: each RayJob gets a list of status steps
(``jobDeploymentStatus`` Initializing -> Running -> Complete/Failed/ValidationFailed,
``jobStatus`` PENDING -> RUNNING -> SUCCEEDED/FAILED, ``reason``/``message``). A step applies at the first GET
at least ``after_s`` seconds (default ``step_seconds``) after the previous change, as a controller moves with time,
not with reads: with the default 0 every GET moves the job one step, so most tests need no timing; a test of
polling sets a dwell and then no burst of reads can hurry the job. A
step may also append lines to the submitter pod's log and JSON lines to a metrics
file (what verl's file logger writes), so progress reporting is exercised. A step
``{"wait_for": GATE}`` holds the job in its current state until the test adds GATE to
``open_gates`` (to stop a waiting worker at a known point).

The controller also applies KubeRay's own spec validation (``ValidateRayJobMetadata`` and ``ValidateRayJobSpec``
in ``ray-operator/controllers/ray/utils/validation.go``, the checks that apply to what this project renders): a
RayJob that fails them is accepted by the API server (KubeRay has no RayJob admission webhook) and then set to
``jobDeploymentStatus=ValidationFailed``, ``reason=ValidationFailed`` with KubeRay's message.

What it does NOT cover: admission webhooks, the real KubeRay controller (RayCluster
creation, submitter Job, backoffLimit retries, TTL and deletion rules), schema
defaulting and CEL ``x-kubernetes-validations`` rules, finalizers (DELETE removes the
object at once), watches, patch/update, ClusterRoles and aggregated roles (only Role/RoleBinding), resourceVersion
conflicts, and set-based label selectors (``in``, ``notin``, existence).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

RAYJOBS = re.compile(r"^/apis/ray\.io/v1/namespaces/([^/]+)/rayjobs(?:/([^/]+))?$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)(/log)?)?$")
RAY_JOB_LOGS = re.compile(r"^/api/jobs/([^/]+)/logs$")  # the Ray dashboard's Jobs REST API
# what `doctor` reads (served from the cluster state the test sets: crds, namespaces, pvcs, secrets, access)
CRDS = re.compile(r"^/apis/apiextensions\.k8s\.io/v1/customresourcedefinitions/([^/]+)$")
NAMESPACE = re.compile(r"^/api/v1/namespaces/([^/]+)$")
PVC = re.compile(r"^/api/v1/namespaces/([^/]+)/persistentvolumeclaims/([^/]+)$")
SECRET = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets/([^/]+)$")
SSAR = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
DEPLOYMENTS = "/apis/apps/v1/deployments"  # list across namespaces (the KubeRay operator's namespace is the user's)
NODES = "/api/v1/nodes"
# any Kubernetes API request, for the authorizer: core (/api/v1) or a group (/apis/<group>/<version>), namespaced or not
API_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)"
    r"(?:/namespaces/(?P<ns>[^/]+)(?=/|$))?(?:/(?P<resource>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?)?$"
)
ROOT = Path(__file__).resolve().parents[2]  # the repository
SHIPPED_RBAC = ROOT / "k8s" / "base" / "rbac.yaml"
RAY_TOKEN_KEY = "auth_token"  # KubeRay's RAY_AUTH_TOKEN_SECRET_KEY

# KubeRay-like scripts: each dict is one observed status (plus optional side effects).
SUCCESS = [
    {"jobDeploymentStatus": "Initializing"},
    {"jobDeploymentStatus": "Running", "jobStatus": "PENDING"},
    {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
    {
        "jobDeploymentStatus": "Complete",
        "jobStatus": "SUCCEEDED",
        "reason": "",
        "message": "Job finished successfully.",
    },
]


MAX_RAYJOB_NAME = 47  # KubeRay's MaxRayJobNameLength
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RAY_START_RESOURCES = ("num-cpus", "num-gpus", "memory", "resources")


def kuberay_validation_error(obj: dict) -> str | None:
    """KubeRay's message for a RayJob its controller refuses, or None (the subset of validation.go that applies)."""
    import yaml

    name = (obj.get("metadata") or {}).get("name") or ""
    if len(name) > MAX_RAYJOB_NAME:
        return f"The RayJob metadata is invalid: RayJob name should be no more than {MAX_RAYJOB_NAME} characters"
    if len(name) > 63 or not DNS1035.match(name):
        return "The RayJob metadata is invalid: RayJob name should be a valid DNS1035 label"
    spec = obj.get("spec") or {}
    if spec.get("suspend") and not spec.get("shutdownAfterJobFinishes"):
        return (
            "The RayJob spec is invalid: a RayJob with shutdownAfterJobFinishes set to false is not allowed to be "
            "suspended"
        )
    if (spec.get("ttlSecondsAfterFinished") or 0) < 0:
        return "The RayJob spec is invalid: TTLSecondsAfterFinished must be a non-negative integer"
    if not spec.get("shutdownAfterJobFinishes") and (spec.get("ttlSecondsAfterFinished") or 0) > 0:
        return (
            "The RayJob spec is invalid: a RayJob with shutdownAfterJobFinishes set to false cannot have "
            "TTLSecondsAfterFinished"
        )
    if spec.get("deletionStrategy"):  # the RayJobDeletionPolicy feature gate is off by default
        return "RayJobDeletionPolicy feature gate must be enabled to use DeletionStrategy"
    cluster = spec.get("rayClusterSpec")
    if cluster is None and not spec.get("clusterSelector"):
        return "The RayJob spec is invalid: one of RayClusterSpec or ClusterSelector must be set"
    if cluster is not None:
        groups = [("Head", cluster.get("headGroupSpec") or {})]
        groups += [(g.get("groupName", ""), g) for g in cluster.get("workerGroupSpecs") or []]
        for group_name, group in groups:
            if not ((group.get("template") or {}).get("spec") or {}).get("containers"):
                which = "headGroupSpec" if group_name == "Head" else "workerGroupSpec"
                return f"The RayJob spec is invalid: {which} should have at least one container"
            params = group.get("rayStartParams") or {}
            if any(params.get(k) for k in RAY_START_RESOURCES) and group.get("resources"):
                return (
                    "The RayJob spec is invalid: resource fields should not be set in both rayStartParams and "
                    f"Resources for {group_name} group; please use only one"
                )
            if "labels" in params:
                return (
                    f"The RayJob spec is invalid: rayStartParams['labels'] is not supported for {group_name} group; "
                    "please use the top-level Labels field instead"
                )
    try:
        env = yaml.safe_load(spec.get("runtimeEnvYAML") or "") or {}
        if not isinstance(env, dict):
            raise ValueError("not a mapping")
    except (yaml.YAMLError, ValueError) as exc:
        return f"failed to unmarshal RuntimeEnvYAML: {str(exc).splitlines()[0]}"
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
        return "The RayJob spec is invalid: activeDeadlineSeconds must be a positive integer"
    if spec.get("backoffLimit") is not None and spec["backoffLimit"] < 0:
        return "The RayJob spec is invalid: backoffLimit must be a positive integer"
    return None


def kuberay_operator(namespace: str = "kuberay-system", version: str = "1.7.0", image: str | None = None) -> dict:
    """The Deployment the kuberay-operator Helm chart (release ``kuberay-operator``) creates: its labels
    (helm-chart/kuberay-operator/templates/_helpers.tpl) and image ``quay.io/kuberay/operator:v<version>``."""
    labels = {
        "app.kubernetes.io/name": "kuberay-operator",
        "helm.sh/chart": f"kuberay-operator-{version}",
        "app.kubernetes.io/instance": "kuberay-operator",
        "app.kubernetes.io/managed-by": "Helm",
        "app.kubernetes.io/component": "kuberay-operator",
    }
    selector = {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")}
    return {
        "metadata": {"name": "kuberay-operator", "namespace": namespace, "labels": labels, "generation": 1},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": {**selector, "app.kubernetes.io/component": "kuberay-operator"}},
                "spec": {
                    "serviceAccountName": "kuberay-operator",
                    "containers": [
                        {
                            "name": "kuberay-operator",
                            "image": image or f"quay.io/kuberay/operator:v{version}",
                            "command": ["/manager"],
                        }
                    ],
                },
            },
        },
        "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1, "observedGeneration": 1},
    }


def gpu_node(
    name: str,
    gpus: int,
    labels: dict | None = None,
    taints: list[dict] | None = None,
    ready: bool = True,
    unschedulable: bool = False,
) -> dict:
    """A node as ``GET /api/v1/nodes`` lists it, with ``gpus`` allocatable ``nvidia.com/gpu`` (the device plugin's
    resource) and the given labels and taints (``{"key", "value", "effect"}``)."""
    spec = {"taints": list(taints or [])}
    if unschedulable:  # kubectl cordon sets it, with the node.kubernetes.io/unschedulable taint
        spec["unschedulable"] = True
        spec["taints"].append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    resources = {"cpu": "128", "memory": "1056Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": spec,
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"}],
        },
    }


def request_attributes(method: str, path: str, query: dict | None = None) -> tuple[str, str, str, str, str, str] | None:
    """(group, resource, subresource, verb, namespace, name) of a Kubernetes API request, as the API server's request
    info resolver reads them; None for a path that is not a resource (the Ray dashboard's, discovery)."""
    m = API_PATH.match(path)
    if not m or not m.group("resource"):
        if m and m.group("ns") and not m.group("resource"):  # /api/v1/namespaces/<ns>: the namespace itself
            return "", "namespaces", "", {"GET": "get", "DELETE": "delete"}.get(method, "update"), "", m.group("ns")
        return None
    group, ns, resource = m.group("group") or "", m.group("ns") or "", m.group("resource")
    name, sub = m.group("name") or "", m.group("sub") or ""
    watch = str((query or {}).get("watch", "")).lower() in ("1", "true")
    verb = {
        "GET": ("get" if name else ("watch" if watch else "list")),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": ("delete" if name else "deletecollection"),
    }.get(method, method.lower())
    return group, resource, sub, verb, ns, name


def granted(grant: set, group: str, resource: str, sub: str, verb: str, ns: str, name: str = "") -> bool:
    """Whether ``grant`` allows it: a 5-tuple ``(group, resource, sub, verb, ns)`` allows every name, a 6-tuple with a
    name only that object (RBAC's ``resourceNames``: never a list or a create, which name no object)."""
    return (group, resource, sub, verb, ns) in grant or bool(name and (group, resource, sub, verb, ns, name) in grant)


def forbidden_message(group: str, resource: str, sub: str, verb: str, ns: str, name: str, who: str = "") -> str:
    """The RBAC authorizer's 403 message."""
    what = f"{resource}{'/' + sub if sub else ''}"
    head = f'{what}{"." + group if group else ""} "{name}"' if name else f"{what}{'.' + group if group else ''}"
    where = f'in the namespace "{ns}"' if ns else "at the cluster scope"
    user = f'User "{who}" ' if who else ""
    return f'{head} is forbidden: {user}cannot {verb} resource "{what}" in API group "{group}" {where}'


def shipped_rbac(path: str | Path = SHIPPED_RBAC) -> list[dict]:
    """The Role and RoleBinding objects the deployment ships (k8s/base/rbac.yaml)."""
    import yaml

    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def rbac_grants(docs: list[dict], account: str, namespace: str, as_namespace: str | None = None) -> set[tuple]:
    """What ServiceAccount ``namespace/account`` may do, from Role and RoleBinding objects, as grant tuples (see
    :func:`granted`). ``as_namespace`` stands in for every Role's namespace (a test's namespace for verl-pipeline)."""
    roles = {(d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs if d.get("kind") == "Role"}
    out: set[tuple] = set()
    for b in (d for d in docs if d.get("kind") == "RoleBinding"):
        if not any(
            s.get("kind") == "ServiceAccount" and (s.get("namespace"), s.get("name")) == (namespace, account)
            for s in b.get("subjects") or []
        ):
            continue
        ref = b["roleRef"]
        if ref.get("kind") != "Role":
            raise ValueError(f"RoleBinding {b['metadata']['name']}: only Roles are modelled, not {ref.get('kind')}")
        ns = b["metadata"].get("namespace", "")
        role = roles.get((ns, ref["name"]))
        if role is None:  # a binding to a missing Role grants nothing, as in Kubernetes
            continue
        where = as_namespace if as_namespace is not None else ns
        for rule in role.get("rules") or []:
            names = rule.get("resourceNames") or []
            for group in rule.get("apiGroups") or []:
                for res in rule.get("resources") or []:
                    resource, _, sub = res.partition("/")
                    for verb in rule.get("verbs") or []:
                        if names:
                            out |= {(group, resource, sub, verb, where, n) for n in names}
                        else:
                            out.add((group, resource, sub, verb, where))
    return out


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status_body(code: int, reason: str, message: str, name: str | None = None) -> dict:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if name:
        body["details"] = {"name": name, "group": "ray.io", "kind": "rayjobs"}
    return body


def _match(labels: dict, selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        m = re.fullmatch(r"([^=!]+?)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise ValueError(f"unsupported label selector term {term!r}")
        key, op, value = m.groups()
        if (labels.get(key) == value) != (op != "!="):
            return False
    return True


@functools.lru_cache(maxsize=4)
def _schema(crd_file: str) -> dict:
    import yaml

    crd = yaml.load(Path(crd_file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


def prune(value, schema: dict):
    """Drop fields the structural schema does not declare, as an API server does for a CRD (in place).

    Unknown fields are kept only under ``x-kubernetes-preserve-unknown-fields``; ``additionalProperties`` maps
    prune each value; ``metadata`` of the object is the API server's own (name, labels, annotations, ...)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return value
        props = schema.get("properties")
        if props is not None:
            for key in list(value):
                if key not in props:
                    value.pop(key)
                else:
                    prune(value[key], props[key])
        elif isinstance(schema.get("additionalProperties"), dict):
            for key in value:
                prune(value[key], schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            prune(item, schema["items"])
    return value


@functools.lru_cache(maxsize=4)
def _validator(crd_file: str):
    """A JSON-schema validator for the CRD's v1 openAPIV3Schema (parsed once: the file is large)."""
    import jsonschema
    import yaml

    crd = yaml.load(Path(crd_file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])


class StandIn:
    """The API server stand-in plus its scripted KubeRay controller.

    :param crd_file: the KubeRay RayJob CRD YAML; when given, created bodies are checked
        against its openAPIV3Schema (422 on failure), as a real API server does.
    """

    def __init__(self, crd_file: str | Path | None = None, executor=None):
        """:param executor: run each valid RayJob's entrypoint for real instead of playing a script
        (:class:`PodRunner`); its process decides the job's status and log."""
        self.executor = executor
        self.objects: dict[tuple[str, str], dict] = {}
        self.scripts: dict[str, list[dict]] = {}
        self.default_script: list[dict] = SUCCESS
        self.job_logs: dict[tuple[str, str], list[str]] = {}  # (namespace, RayJob name) -> the Ray job's log
        self.metrics_files: dict[str, Path] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.creates: list[dict] = []  # every body that was created (not the 409s)
        self.deletes: list[str] = []
        self.open_gates: set[str] = set()
        self.dashboard_host: str | None = None  # set by start(): this server also answers /api/jobs/<id>/logs
        self.lock = threading.RLock()
        self._validator = _validator(str(crd_file)) if crd_file else None
        self._schema = _schema(str(crd_file)) if crd_file else None
        self.deletion_polls = 2  # a deleted object lingers (deletionTimestamp set) for this many reads
        self.step_seconds = 0.0  # the default dwell of a scripted step (its "after_s" overrides it)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        # bearer-token authentication as a real API server does it: a request to the Kubernetes API without this
        # server's token gets 401 Unauthorized (the Ray dashboard path it also serves has no Kubernetes auth)
        self.token = f"stand-in-{uuid.uuid4().hex}"
        self.unauthorized = 0
        # cluster state for `doctor`: CRD name -> served versions; namespaces; (ns, claim) -> phase; (ns, secret) ->
        # {key: base64 value}; the caller's allowed (group, resource, subresource, verb, ns), None = everything
        self.crds: dict[str, list[str]] = {"rayjobs.ray.io": ["v1"]}
        self.namespaces: set[str] = {"default", "verl-pipeline"}
        self.pvcs: dict[tuple[str, str], str] = {}
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.access: set[tuple[str, str, str, str, str]] | None = None
        self.deployments: list[dict] = []  # Deployment objects (kuberay_operator())
        self.nodes: list[dict] = []  # Node objects (gpu_node())
        # extra bearer tokens, each with what its identity may do (RBAC grant tuples, normally from the shipped Roles:
        # identity()): every API request outside the grant gets 403 Forbidden, as the API server's authorizer answers
        self.identities: dict[str, set[tuple]] = {}
        self.identity_names: dict[str, str] = {}  # token -> "system:serviceaccount:<ns>:<name>" (403 messages)
        self._caller: set | None = None  # the grant of the request being handled (None: this server's own token)
        self.ray_tokens: dict[tuple[str, str], str] = {}  # (ns, Secret) -> the Ray token KubeRay generated into it
        self.dashboard_requests: list[bool] = []  # per dashboard request to a token cluster: did it carry a token

    # -- scripting ---------------------------------------------------------------------------------
    def script(self, name: str, steps: list[dict], metrics_file: str | Path | None = None) -> None:
        """Status steps the controller plays for the RayJob ``name`` (any attempt created later)."""
        self.scripts[name] = [dict(s) for s in steps]
        if metrics_file:
            self.metrics_files[name] = Path(metrics_file)

    def status(self, name: str, namespace: str = "default") -> dict | None:
        obj = self.objects.get((namespace, name))
        return None if obj is None else copy.deepcopy(obj.get("status") or {})

    def identity(
        self, account: str, namespace: str = "airflow", docs: list[dict] | None = None, as_namespace: str | None = None
    ) -> str:
        """A bearer token for ServiceAccount ``namespace/account`` with what the Roles bound to it grant (``docs``:
        the shipped k8s/base/rbac.yaml by default); ``as_namespace`` stands in for the Roles' namespace."""
        token = f"sa-{namespace}-{account}-{uuid.uuid4().hex[:8]}"
        self.identities[token] = rbac_grants(shipped_rbac() if docs is None else docs, account, namespace, as_namespace)
        self.identity_names[token] = f"system:serviceaccount:{namespace}:{account}"
        return token

    def count_creates(self, name_prefix: str = "") -> int:
        return sum(1 for b in self.creates if b["metadata"]["name"].startswith(name_prefix))

    # -- server lifecycle --------------------------------------------------------------------------
    def start(self) -> str:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _send(self, code: int, body, content_type="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _dispatch(self, method: str):
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                body = None
                if method == "POST":
                    length = int(self.headers.get("Content-Length") or 0)
                    try:
                        body = json.loads(self.rfile.read(length) or b"{}")
                    except json.JSONDecodeError:
                        return self._send(400, _status_body(400, "BadRequest", "request body is not JSON"))
                auth = self.headers.get("Authorization") or ""
                kube = url.path.startswith(("/api/v1/", "/apis/")) or url.path in ("/api/v1", "/apis")
                token = auth.removeprefix("Bearer ")
                grant = stand_in.identities.get(token) if kube else None
                if kube and auth != f"Bearer {stand_in.token}" and grant is None:
                    with stand_in.lock:
                        stand_in.unauthorized += 1
                    return self._send(401, _status_body(401, "Unauthorized", "Unauthorized"))
                attrs = request_attributes(method, url.path, query) if grant is not None else None
                if attrs and url.path != SSAR and not granted(grant, *attrs):
                    with stand_in.lock:
                        stand_in.requests.append((method, url.path))
                    message = forbidden_message(*attrs, who=stand_in.identity_names.get(token, ""))
                    return self._send(403, _status_body(403, "Forbidden", message, attrs[5] or None))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with stand_in.lock:
                    stand_in.requests.append((method, url.path))
                    stand_in._caller = grant
                    try:
                        code, out, ctype = stand_in.handle(method, url.path, query, body, headers)
                    finally:
                        stand_in._caller = None
                self._send(code, out, ctype)

            def do_GET(self):
                self._dispatch("GET")

            def do_POST(self):
                self._dispatch("POST")

            def do_DELETE(self):
                self._dispatch("DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="k8s-stand-in", daemon=True)
        self._thread.start()
        self.dashboard_host = f"127.0.0.1:{self._server.server_address[1]}"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def kube_config(self, path: str | Path, namespace: str = "default", token: str | None = None) -> Path:
        """Write a kube config pointing at this server (token auth: the clients send a bearer header); ``token``
        overrides this server's token (a wrong one is refused with 401)."""
        import yaml

        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": token or self.token}}],
            "contexts": [
                {"name": "stand-in", "context": {"cluster": "stand-in", "user": "tester", "namespace": namespace}}
            ],
            "current-context": "stand-in",
        }
        Path(path).write_text(yaml.safe_dump(cfg))
        return Path(path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- API -----------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict, body, headers: dict | None = None):
        m = RAYJOBS.match(path)
        if m and "rayjobs.ray.io" not in self.crds:  # no CRD, no ray.io/v1 API
            return (
                404,
                _status_body(404, "NotFound", "the server could not find the requested resource"),
                "application/json",
            )
        if m:
            ns, name = m.groups()
            if method == "POST" and not name:
                return self._create(ns, body)
            if method == "GET" and not name:
                return self._list(ns, query.get("labelSelector", ""))
            if method == "GET":
                return self._get(ns, name)
            if method == "DELETE":
                return self._delete(ns, name)
            return 405, _status_body(405, "MethodNotAllowed", f"{method} not supported here"), "application/json"
        m = PODS.match(path)
        if m and method == "GET":
            ns, pod, log = m.groups()
            if pod and log:
                lines = self.job_logs.get((ns, pod.rsplit("-", 1)[0])) if pod in self._pods(ns) else None
                if lines is None:
                    return 404, _status_body(404, "NotFound", f'pods "{pod}" not found', pod), "application/json"
                tail = int(query.get("tailLines", 0) or 0)
                return 200, "".join(line + "\n" for line in (lines[-tail:] if tail else lines)), "text/plain"
            if not pod:
                selector = query.get("labelSelector", "")
                items = [self._pod(ns, p) for p in self._pods(ns)]
                items = [i for i in items if _match(i["metadata"]["labels"], selector)]
                return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}, "application/json"
        found = self._cluster_state(method, path, body, query)
        if found is not None:
            return found
        m = RAY_JOB_LOGS.match(path)
        if m and method == "GET":  # HTTPMode: the job's log comes from the head's dashboard
            for (ns, name), obj in self.objects.items():
                if (obj.get("status") or {}).get("jobId") == m.group(1) and (ns, name) in self.job_logs:
                    refused = self._ray_auth_refusal(ns, obj, headers or {})
                    if refused:
                        return refused
                    return 200, {"logs": "".join(line + "\n" for line in self.job_logs[(ns, name)])}, "application/json"
            return 404, f"Job {m.group(1)} does not exist", "text/plain"
        return (
            404,
            _status_body(404, "NotFound", f"the server could not find the requested resource ({path})"),
            "application/json",
        )

    def allowed(self, group: str, resource: str, sub: str, verb: str, ns: str, name: str = "") -> bool:
        """What the caller may do: an identity's grant, else this server's own token with ``access`` (None: all)."""
        if self._caller is not None:
            return granted(self._caller, group, resource, sub, verb, ns, name)
        return self.access is None or (group, resource, sub, verb, ns) in self.access

    # -- Ray token authentication (KubeRay authOptions) ---------------------------------------------------------
    @staticmethod
    def _auth_options(obj: dict) -> dict:
        return ((obj.get("spec") or {}).get("rayClusterSpec") or {}).get("authOptions") or {}

    def _ray_token_secret(self, obj: dict) -> str | None:
        """The Secret holding the cluster's Ray token (KubeRay: authOptions.secretName, else the RayCluster's name)."""
        auth = self._auth_options(obj)
        if str(auth.get("mode") or "").lower() != "token":
            return None
        return auth.get("secretName") or (obj.get("status") or {}).get("rayClusterName")

    def _ensure_ray_token(self, ns: str, obj: dict) -> None:
        """As KubeRay does when the cluster is created: a Secret with a random token unless it exists."""
        import base64

        secret = self._ray_token_secret(obj)
        if secret and (ns, secret) not in self.secrets:
            token = uuid.uuid4().hex
            self.secrets[(ns, secret)] = {RAY_TOKEN_KEY: base64.b64encode(token.encode()).decode()}
            if not self._auth_options(obj).get("secretName"):
                self.ray_tokens[(ns, secret)] = token  # KubeRay's own: deleted with the cluster

    def ray_token(self, ns: str, obj_or_name) -> str | None:
        """The Ray token a RayJob's cluster expects (None: token authentication is off)."""
        import base64

        obj = self.objects.get((ns, obj_or_name)) if isinstance(obj_or_name, str) else obj_or_name
        secret = self._ray_token_secret(obj or {})
        data = self.secrets.get((ns, secret)) if secret else None
        if not data or RAY_TOKEN_KEY not in data:
            return None
        return base64.b64decode(data[RAY_TOKEN_KEY]).decode().strip()

    def _ray_auth_refusal(self, ns: str, obj: dict, headers: dict):
        """Ray's token middleware: 401 without a token, 403 with a wrong one, None when the request may pass."""
        if self._ray_token_secret(obj) is None:
            return None
        header = headers.get("authorization") or headers.get("x-ray-authorization") or ""
        self.dashboard_requests.append(bool(header))
        if not header:
            return 401, "Unauthorized: Missing authentication token", "text/plain"
        expected = self.ray_token(ns, obj)
        if expected is None or header != f"Bearer {expected}":
            return 403, "Forbidden: Invalid authentication token", "text/plain"
        return None

    def _cluster_state(self, method: str, path: str, body, query: dict):
        """CRDs, namespaces, PVCs, Secrets, SelfSubjectAccessReviews, Deployments and nodes, as the API server answers
        them."""
        j = "application/json"

        def missing(kind, name):
            return 404, _status_body(404, "NotFound", f'{kind} "{name}" not found', name), j

        if method == "POST" and path == SSAR:
            attrs = (body.get("spec") or {}).get("resourceAttributes") or {}
            ok = self.allowed(
                attrs.get("group") or "",
                attrs.get("resource") or "",
                attrs.get("subresource") or "",
                attrs.get("verb") or "",
                attrs.get("namespace") or "",
            )
            return 201, {**body, "status": {"allowed": ok}}, j
        if method != "GET":
            return None
        if path in (DEPLOYMENTS, NODES):
            group, resource, kind = (
                ("apps", "deployments", "Deployment") if path == DEPLOYMENTS else ("", "nodes", "Node")
            )
            if not self.allowed(group, resource, "", "list", ""):
                what = f"{resource}.{group}" if group else resource
                msg = f'{what} is forbidden: cannot list resource "{resource}" in API group "{group}" at the cluster '
                msg += "scope"
                return 403, _status_body(403, "Forbidden", msg), j
            items = self.deployments if path == DEPLOYMENTS else self.nodes
            try:
                items = [o for o in items if _match(o["metadata"].get("labels") or {}, query.get("labelSelector", ""))]
            except ValueError as exc:
                return 400, _status_body(400, "BadRequest", str(exc)), j
            version = "apps/v1" if group else "v1"
            return 200, {"kind": f"{kind}List", "apiVersion": version, "metadata": {}, "items": items}, j
        if m := CRDS.match(path):
            if not self.allowed("apiextensions.k8s.io", "customresourcedefinitions", "", "get", ""):
                msg = "customresourcedefinitions.apiextensions.k8s.io is forbidden"
                return 403, _status_body(403, "Forbidden", msg, m.group(1)), j
            if m.group(1) not in self.crds:
                return missing("customresourcedefinitions.apiextensions.k8s.io", m.group(1))
            versions = [{"name": v, "served": True, "storage": i == 0} for i, v in enumerate(self.crds[m.group(1)])]
            plural, _, group = m.group(1).partition(".")
            crd = {
                "kind": "CustomResourceDefinition",
                "metadata": {"name": m.group(1)},
                "spec": {
                    "group": group,
                    "names": {"plural": plural, "kind": "RayJob"},
                    "scope": "Namespaced",
                    "versions": versions,
                },
            }
            return 200, crd, j
        if m := NAMESPACE.match(path):
            if m.group(1) not in self.namespaces:
                return missing("namespaces", m.group(1))
            return 200, {"kind": "Namespace", "metadata": {"name": m.group(1)}, "status": {"phase": "Active"}}, j
        if m := PVC.match(path):
            if tuple(m.groups()) not in self.pvcs:
                return missing("persistentvolumeclaims", m.group(2))
            return (
                200,
                {
                    "kind": "PersistentVolumeClaim",
                    "metadata": {"name": m.group(2), "namespace": m.group(1)},
                    "spec": {},
                    "status": {"phase": self.pvcs[tuple(m.groups())]},
                },
                j,
            )
        if m := SECRET.match(path):
            ns, name = m.groups()
            if not self.allowed("", "secrets", "", "get", ns, name):
                msg = f'secrets "{name}" is forbidden: cannot get resource "secrets" in namespace "{ns}"'
                return 403, _status_body(403, "Forbidden", msg, name), j
            if (ns, name) not in self.secrets:
                return missing("secrets", name)
            return (
                200,
                {"kind": "Secret", "metadata": {"name": name, "namespace": ns}, "data": dict(self.secrets[(ns, name)])},
                j,
            )
        return None

    def _pods(self, ns: str) -> list[str]:
        """KubeRay's submitter pods: only K8sJobMode RayJobs have one (HTTPMode submits over HTTP)."""
        return [
            f"{name}-sbmt"
            for (n, name), obj in self.objects.items()
            if n == ns
            and (ns, name) in self.job_logs
            and (obj.get("spec") or {}).get("submissionMode", "K8sJobMode") == "K8sJobMode"
        ]

    def _pod(self, ns: str, pod: str) -> dict:
        job = pod.rsplit("-", 1)[0]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod,
                "namespace": ns,
                "labels": {"batch.kubernetes.io/job-name": job, "job-name": job},
            },
            "spec": {"containers": [{"name": "ray-job-submitter", "image": "rayproject/ray"}]},
            "status": {"phase": "Running"},
        }

    def _create(self, ns: str, body):
        name = ((body or {}).get("metadata") or {}).get("name")
        if not name:
            return 422, _status_body(422, "Invalid", "metadata.name: Required value"), "application/json"
        if body.get("apiVersion") != "ray.io/v1" or body.get("kind") != "RayJob":
            return 400, _status_body(400, "BadRequest", "body is not a ray.io/v1 RayJob"), "application/json"
        body_ns = body["metadata"].get("namespace")
        if body_ns and body_ns != ns:  # the API server refuses a body for another namespace than the URL's
            msg = "the namespace of the provided object does not match the namespace sent on the request"
            return 400, _status_body(400, "BadRequest", msg, name), "application/json"
        if self._validator is not None:
            errors = sorted(self._validator.iter_errors(body), key=lambda e: list(e.path))
            if errors:
                e = errors[0]
                where = ".".join(str(p) for p in e.path)
                return (
                    422,
                    _status_body(422, "Invalid", f'RayJob.ray.io "{name}" is invalid: {where}: {e.message}', name),
                    "application/json",
                )
        if (ns, name) in self.objects:
            return (
                409,
                _status_body(409, "AlreadyExists", f'rayjobs.ray.io "{name}" already exists', name),
                "application/json",
            )
        obj = copy.deepcopy(body)
        obj.pop("status", None)  # status is a subresource: a create never sets it
        if self._schema is not None:
            meta = obj.get("metadata")
            prune(obj, self._schema)  # structural schema: unknown fields are dropped, not stored
            obj["metadata"] = meta
        meta = obj["metadata"]
        meta.update(
            namespace=ns,
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
            generation=1,
            resourceVersion=str(len(self.requests)),
        )
        self.objects[(ns, name)] = obj
        self.creates.append(copy.deepcopy(obj))
        script = self.scripts.get(name)
        if script is None:
            base = next((k for k in self.scripts if name.startswith(k + "-")), None)  # later attempts of a scripted job
            script = self.scripts.get(base, self.default_script) if base else self.default_script
        invalid = kuberay_validation_error(obj)
        if invalid:  # KubeRay's controller refuses it on its first reconcile, whatever the test scripted
            script = [{"jobDeploymentStatus": "ValidationFailed", "reason": "ValidationFailed", "message": invalid}]
        if self.executor is not None and not invalid:
            obj["_run"] = self.executor.start(copy.deepcopy(obj))  # the pods' work, for real
            script = []
        obj["_script"] = [dict(s) for s in script]  # private to the stand-in; stripped from responses
        obj["_changed"] = time.monotonic()
        obj["_metrics"] = self.metrics_files.get(name) or next(
            (p for k, p in self.metrics_files.items() if name.startswith(k + "-")), None
        )
        return 201, self._public(obj), "application/json"

    def _advance(self, ns: str, obj: dict) -> None:
        """One controller reconcile: apply the next scripted step, with its side effects."""
        if obj.get("_run") is not None:
            run = obj["_run"]
            self.job_logs[(ns, obj["metadata"]["name"])] = run.log_lines()
            code = run.poll()
            if code is None:
                step = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
            elif code == 0:
                step = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "message": "Job finished"}
            else:  # KubeRay v1.7.0 for an application failure
                step = {
                    "jobDeploymentStatus": "Failed",
                    "jobStatus": "FAILED",
                    "reason": "AppFailed",
                    "message": f"Job entrypoint command failed with exit code {code}",
                }
            obj["_script"] = [step]
        script = obj["_script"]
        if script and "wait_for" in script[0]:  # a gate: the job stays as it is until the test opens it
            if script[0]["wait_for"] not in self.open_gates:
                return
            script.pop(0)
        if not script:
            return
        if time.monotonic() - obj["_changed"] < float(script[0].get("after_s", self.step_seconds)):
            return  # the controller has not got there yet, however often it is read
        step = {k: v for k, v in script.pop(0).items() if k != "after_s"}
        obj["_changed"] = time.monotonic()
        name = obj["metadata"]["name"]
        status = obj.setdefault("status", {})
        if step.get("jobDeploymentStatus") in ("Initializing", "Running") and "rayClusterName" not in status:
            status["rayClusterName"] = f"{name}-raycluster"
            # a real one is the head service's in-cluster address; here this server answers the dashboard API too
            status["dashboardURL"] = self.dashboard_host or f"{name}-raycluster-head-svc.{ns}.svc.cluster.local:8265"
            status["jobId"] = obj.get("spec", {}).get("jobId") or name
            status["startTime"] = _now()
            self._ensure_ray_token(ns, obj)
        if status.get("jobStatus") or step.get("jobStatus"):
            self.job_logs.setdefault((ns, name), [])
        for line in step.pop("log", []):
            self.job_logs.setdefault((ns, name), []).append(line)
        metrics = step.pop("metrics", [])
        if metrics and obj["_metrics"]:
            obj["_metrics"].parent.mkdir(parents=True, exist_ok=True)
            with obj["_metrics"].open("a") as f:
                for row in metrics:
                    f.write(json.dumps(row) + "\n")
        status.update(step)
        status["observedGeneration"] = 1
        if status.get("jobDeploymentStatus") in ("Complete", "Failed", "ValidationFailed"):
            status.setdefault("endTime", _now())
            status["failed" if status.get("jobStatus") != "SUCCEEDED" else "succeeded"] = 1

    def _get(self, ns: str, name: str):
        obj = self.objects.get((ns, name))
        if obj is not None and obj["metadata"].get("deletionTimestamp"):
            obj["_linger"] -= 1  # being deleted: its finalizers (the RayCluster) take a little while
            if obj["_linger"] < 0:
                self.objects.pop((ns, name), None)
                obj = None
        if obj is None:
            return 404, _status_body(404, "NotFound", f'rayjobs.ray.io "{name}" not found', name), "application/json"
        self._advance(ns, obj)
        return 200, self._public(obj), "application/json"

    def _list(self, ns: str, selector: str):
        try:
            items = [
                self._public(o)
                for (n, _), o in sorted(self.objects.items())
                if n == ns and _match(o["metadata"].get("labels") or {}, selector)
            ]
        except ValueError as exc:
            return 400, _status_body(400, "BadRequest", str(exc)), "application/json"
        return (
            200,
            {"apiVersion": "ray.io/v1", "kind": "RayJobList", "metadata": {"resourceVersion": "1"}, "items": items},
            "application/json",
        )

    def _delete(self, ns: str, name: str):
        obj = self.objects.get((ns, name))
        if obj is not None and self.deletion_polls > 0:  # lingers with a deletion timestamp, then is gone
            obj["metadata"].setdefault("deletionTimestamp", _now())
            obj.setdefault("_linger", self.deletion_polls)
        else:
            self.objects.pop((ns, name), None)
        if obj is None:
            return 404, _status_body(404, "NotFound", f'rayjobs.ray.io "{name}" not found', name), "application/json"
        self.deletes.append(name)
        self.job_logs.pop((ns, name), None)  # the cluster and submitter go with it
        secret = self._ray_token_secret(obj)
        if secret and self.ray_tokens.pop((ns, secret), None) is not None:  # KubeRay's generated Secret goes too
            self.secrets.pop((ns, secret), None)
        return (
            200,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {"name": name, "group": "ray.io", "kind": "rayjobs", "uid": obj["metadata"]["uid"]},
            },
            "application/json",
        )

    @staticmethod
    def _public(obj: dict) -> dict:
        return {k: copy.deepcopy(v) for k, v in obj.items() if not k.startswith("_")}


class PodRunner:
    """Runs a RayJob's entrypoint the way its pod would: ``/bin/sh -c <entrypoint>`` (as Ray's job supervisor does),
    with the container's plain env, its secrets resolved by reference from ``secrets`` (``{(secret, key): value}``;
    an optional missing one is left out, a required one fails the job as a pod would not start), the job's
    runtime env, and the bucket mount path mapped onto a local store directory. ``swaps`` replace parts of the
    entrypoint that cannot run here (the GPU trainer module, vLLM): the test says which."""

    def __init__(
        self,
        workdir: Path,
        cwd: Path,
        mount_path: str,
        store_dir: Path,
        secrets=None,
        swaps=(),
        base_env=None,
        kill_first=None,
    ):
        """:param kill_first: ``(needle, condition)``: the first run whose command contains ``needle`` is killed
        (SIGKILL to its process group, as a node loss would) once ``condition(env)`` is true."""
        self.workdir, self.cwd, self.mount_path, self.store_dir = Path(workdir), Path(cwd), mount_path, str(store_dir)
        self.kill_first, self.killed = kill_first, []
        self.secrets, self.swaps, self.base_env = dict(secrets or {}), list(swaps), dict(base_env or {})
        self.started: list[dict] = []  # {"name", "command", "env"} of every run

    def _map(self, text: str) -> str:
        return text.replace(self.mount_path, self.store_dir)

    def start(self, obj: dict) -> "_Run":
        import subprocess

        import yaml

        spec = obj["spec"]
        cluster = spec["rayClusterSpec"]
        groups = cluster.get("workerGroupSpecs") or []
        container = (groups[0] if groups else cluster["headGroupSpec"])["template"]["spec"]["containers"][0]
        env = dict(self.base_env)
        missing = []
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = self._map(str(e["value"]))
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                if (ref["name"], ref["key"]) in self.secrets:
                    env[e["name"]] = self.secrets[(ref["name"], ref["key"])]
                elif not ref.get("optional"):
                    missing.append(f"{ref['name']}/{ref['key']}")
        runtime = yaml.safe_load(spec.get("runtimeEnvYAML") or "") or {}
        env.update({k: self._map(str(v)) for k, v in (runtime.get("env_vars") or {}).items()})
        command = self._map(spec["entrypoint"])
        for old, new in self.swaps:
            command = command.replace(old, new)
        name = obj["metadata"]["name"]
        self.started.append({"name": name, "command": command, "env": env})
        log = self.workdir / f"{name}.log"
        if missing:  # the pod would not start: CreateContainerConfigError
            log.write_text(f"secret not found: {missing}\n")
            return _Run(None, log, 1)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", command],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                start_new_session=True,
            )
        if self.kill_first and not self.killed and self.kill_first[0] in command:
            self.killed.append(name)
            threading.Thread(target=self._kill_when, args=(proc, env), daemon=True).start()
        return _Run(proc, log, None)

    def _kill_when(self, proc, env: dict) -> None:
        import os
        import signal
        import time

        while proc.poll() is None:
            if self.kill_first[1](env):
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.1)


class _Run:
    def __init__(self, proc, log: Path, code):
        self.proc, self.log, self.code = proc, log, code

    def poll(self):
        return self.code if self.proc is None else self.proc.poll()

    def log_lines(self) -> list[str]:
        try:
            return self.log.read_text(errors="replace").splitlines()
        except OSError:
            return []
