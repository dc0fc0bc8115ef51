"""Render the KubeRay RayJob that runs an experiment on the cluster.

``python -m pipeline_steps render-rayjob --experiment FILE [--override KEY=VALUE ...] --output FILE``

The RayJob is ``k8s/templates/rayjob.yaml`` (the one source of truth) with its
marked fields filled: a deterministic name and ``spec.jobId`` from the DAG run
(a retry finds the same job), labels with dag/run/task ids, the entrypoint
``python3 -m pipeline_steps.training.verl_main <overrides>`` (verl's ``main_ppo`` with the metrics history
kept across attempts) with every argument shell-quoted,
store URIs turned into paths on the bucket mounts, checkpoints
(``trainer.default_local_dir``), verl's file logger and (with the tensorboard logger) ``$TENSORBOARD_DIR`` on the
shared mount,
``trainer.resume_mode=auto`` so a new attempt resumes, secrets only through
``secretKeyRef``, a deadline, cleanup after the job and an optional Kueue queue.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import posixpath
import re
import shlex
from pathlib import Path

import yaml

from pipeline_steps import settings, tracking_run
from pipeline_steps.constants import RAYJOB_NAME_MAX
from pipeline_steps.errors import UserError
from pipeline_steps.store.store_uri import SCHEMES
from pipeline_steps.training.experiment import Experiment
from pipeline_steps.training.mounts import MountMap, split_uri

TEMPLATE = Path(__file__).with_name("rayjob_template.yaml")  # package data; k8s/templates/rayjob.yaml links here
LABEL_DAG, LABEL_RUN, LABEL_TASK = "dag_id", "run_id", "task_id"  # as the cncf-kubernetes provider labels pods
LABEL_KIND = "app.kubernetes.io/component"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ANNOTATION_PREFIX = "verl-grpo-pipeline/"
IMAGE_ENV = settings.TRAIN_IMAGE
SERVICE_ACCOUNT_ENV = settings.RAY_SERVICE_ACCOUNT
RAY_AUTH_SECRET_ENV = settings.RAY_AUTH_SECRET  # a Secret holding the clusters' Ray token (else KubeRay makes one)
MAIN_PPO = ["python3", "-m", "pipeline_steps.training.verl_main"]  # verl.trainer.main_ppo, history kept

_LABEL_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_SECRET_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
_SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY|API_KEY", re.I)
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")


# -- names and labels -------------------------------------------------------------------------------


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _slug(s: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", str(s).lower())).strip("-")


def rayjob_name(dag_id: str, run_id: str, task_id: str, job_kind: str) -> str:
    """Deterministic RayJob name: DNS-1035 label, <= 47 chars (KubeRay's limit, under 63), hash-suffixed.

    The hash covers all four inputs, so two runs never share a name however they slug.
    """
    h = _digest(dag_id, run_id, task_id, job_kind)[:10]
    kind = _slug(job_kind)[:8].strip("-")
    kind = kind if kind[:1].isalpha() else f"j{kind}"[:8].strip("-") or "job"
    parts = [kind] + [p for p in (_slug(dag_id)[:12].strip("-"), _slug(task_id)[:12].strip("-")) if p] + [h]
    return "-".join(parts)[:RAYJOB_NAME_MAX]


def label_value(value: str) -> str:
    """A valid label value for any string (<= 63 chars; hash-suffixed when it had to change)."""
    value = str(value)
    safe = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9_.-]|[^A-Za-z0-9]+$", "", value)
    if len(safe) > 63 or safe != value:
        h = _digest(value)[:9]
        head = safe[:53].rstrip("-_.")
        safe = f"{head}-{h}" if head else h
    assert _LABEL_RE.match(safe) and len(safe) <= 63
    return safe


def metrics_uri(ckpt_uri: str) -> str:
    """verl's file-logger output, next to the checkpoints directory."""
    return posixpath.join(posixpath.dirname(ckpt_uri.rstrip("/")), "metrics.jsonl")


def tensorboard_uri(ckpt_uri: str) -> str:
    """verl's tensorboard logger's directory (``$TENSORBOARD_DIR``), next to the checkpoints directory."""
    return tracking_run.tensorboard_dir(posixpath.dirname(ckpt_uri.rstrip("/")))


def rollouts_uri(ckpt_uri: str) -> str:
    """verl's per-step generation dump (``trainer.rollout_data_dir``), next to the checkpoints directory: where the
    run report reads trajectories (as the local trainer writes them)."""
    return posixpath.join(posixpath.dirname(ckpt_uri.rstrip("/")), "rollouts")


# -- config sections ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _template_text() -> str:
    return TEMPLATE.read_text(encoding="utf-8")


def load_template() -> dict:
    """A fresh copy of the RayJob template."""
    return yaml.safe_load(_template_text())


def _int(value, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{what}={value!r}: must be an integer >= {minimum}")
    return value


def _quantity(value, what: str) -> str:
    s = str(value)
    if not _QUANTITY.match(s):
        raise UserError(f"{what}={value!r}: not a Kubernetes quantity (for example 8, 500m, 32Gi)")
    return s


def _resources(section: dict | None, what: str, defaults: dict) -> dict:
    section = dict(section or {})
    unknown = set(section) - {"cpu", "memory", "shm"}
    if unknown:
        raise UserError(f"{what}: unknown keys {sorted(unknown)}; allowed: cpu, memory, shm")
    return {k: _quantity(section.get(k, defaults[k]), f"{what}.{k}") for k in defaults}


def _secret_env(cluster: dict) -> list[dict]:
    """Container env entries that read secrets by name (``cluster.secrets``); never a literal value."""
    out = []
    for i, s in enumerate(cluster.get("secrets") or []):
        what = f"cluster.secrets[{i}]"
        if not isinstance(s, dict) or set(s) - {"env", "secret", "key", "optional"}:
            raise UserError(
                f"{what}: expected {{env, secret, key[, optional]}} naming a Kubernetes Secret, never a value"
            )
        env, secret, key = str(s.get("env", "")), str(s.get("secret", "")), str(s.get("key", ""))
        if not _ENV_RE.match(env):
            raise UserError(f"{what}.env={env!r}: not an environment variable name")
        if not _DNS_SUBDOMAIN.match(secret):
            raise UserError(f"{what}.secret={secret!r}: not a Kubernetes Secret name (lower-case DNS name)")
        if not _SECRET_KEY_RE.match(key):
            raise UserError(f"{what}.key={key!r}: not a Secret data key")
        ref = {"name": secret, "key": key}
        if "optional" in s:
            if not isinstance(s["optional"], bool):
                raise UserError(f"{what}.optional must be true or false")
            ref["optional"] = s["optional"]
        out.append({"name": env, "valueFrom": {"secretKeyRef": ref}})
    return out


def _ray_env(cluster: dict) -> dict:
    """``cluster.ray_env``: variables for Ray's runtime env only (the job's driver and workers), not the containers.

    Ray expands ``${VAR}`` in them from the process's environment (``ray._private.utils.update_envs``), so a value
    can extend the image's own, e.g. ``LD_LIBRARY_PATH: /usr/local/cuda/compat:${LD_LIBRARY_PATH}``; a container env
    value cannot (Kubernetes expands only ``$(VAR)`` of variables set in the same container spec).
    """
    env = cluster.get("ray_env") or {}
    if not isinstance(env, dict):
        raise UserError("cluster.ray_env: expected a mapping of NAME: value (non-secret settings only)")
    out = {}
    for k, v in env.items():
        if not _ENV_RE.match(str(k)) or _SECRETISH.search(str(k)):
            raise UserError(f"cluster.ray_env: {k!r} is not a non-secret environment variable name")
        out[str(k)] = str(v)
    return out


_RAY_START_KEYS = {"num-cpus", "num-gpus", "memory", "object-store-memory"}


def _ray_start_params(cluster: dict) -> dict:
    """``cluster.worker_ray_start_params``: Ray start parameters of the GPU worker group (e.g. guide 004's num-cpus).

    KubeRay 1.7 refuses these resource parameters only together with the group-level ``resources`` field
    (``ValidateRayClusterSpec`` in ray-operator/controllers/ray/utils/validation.go), which the renderer never sets.
    """
    params = cluster.get("worker_ray_start_params") or {}
    if not isinstance(params, dict) or set(params) - _RAY_START_KEYS:
        raise UserError(
            f"cluster.worker_ray_start_params: expected a mapping with keys among {sorted(_RAY_START_KEYS)}"
        )
    return {str(k): str(v) for k, v in params.items()}


def _plain_env(cluster: dict) -> dict:
    env = cluster.get("env") or {}
    if not isinstance(env, dict):
        raise UserError("cluster.env: expected a mapping of NAME: value (non-secret settings only)")
    out = {}
    for k, v in env.items():
        if not _ENV_RE.match(str(k)):
            raise UserError(f"cluster.env: {k!r} is not an environment variable name")
        if _SECRETISH.search(str(k)):
            raise UserError(
                f"cluster.env.{k}: looks like a secret; reference a Kubernetes Secret in cluster.secrets instead"
            )
        out[str(k)] = str(v)
    return out


SANDBOX_DOMAIN_ENV = settings.E2B_DOMAIN  # the deployment's default sandbox service, for presets that name none
SANDBOX_SERVICES_ENV = settings.SANDBOX_SERVICES  # the deployment's named sandbox services (JSON, Helm values)
SANDBOX_KEY_SECRET = {"secret": "sandbox-api-key", "key": "apiKey"}  # the default service's API key (k8s/secrets/)
_HOST = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")
_SERVICE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SERVICES_SHAPE = '{"<name>": {"domain": "<E2B domain>", "secret": "<Secret name>", "key": "<key, default apiKey>"}}'


def sandbox_service_capacity(cluster: dict | None) -> tuple[int | None, str]:
    """The sandbox service a preset's ``cluster.sandbox_service`` names (else the deployment's default): its capacity
    (None: unknown) and where that comes from, for the pre-flight's sandbox count."""
    from pipeline_steps import settings

    name = cluster.get("sandbox_service") if isinstance(cluster, dict) else None
    if name is None:
        domain = settings.get(SANDBOX_DOMAIN_ENV) or "(unset)"
        return None, f"the deployment's default sandbox service ${SANDBOX_DOMAIN_ENV}={domain}"
    svc = sandbox_services().get(name)
    if svc is None:
        return None, f"cluster.sandbox_service={name}"  # an unknown name: the RayJob render refuses it
    where = f"cluster.sandbox_service={name} (${SANDBOX_SERVICES_ENV}[{name!r}].capacity"
    return svc.get("capacity"), where + (")" if svc.get("capacity") else ": unset)")


def sandbox_services() -> dict[str, dict]:
    """The deployment's named sandbox services: ``$PIPELINE_SANDBOX_SERVICES`` (Helm values), name -> the E2B
    domain and the Kubernetes Secret (name, data key) holding its API key, and optionally its ``capacity`` (sandboxes
    at once, which the pre-flight checks a rollout against). Endpoints and Secret names only, never a key: presets
    of different sandbox services (guide 000's sandbox-manager, guide 003's AGS region) run from one Airflow, each
    naming its service by ``cluster.sandbox_service``."""
    raw = (settings.get(SANDBOX_SERVICES_ENV) or "").strip()
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise UserError(f"${SANDBOX_SERVICES_ENV}: not JSON; expected {_SERVICES_SHAPE}") from None
    if not isinstance(data, dict):
        raise UserError(f"${SANDBOX_SERVICES_ENV}: expected a JSON object {_SERVICES_SHAPE}")
    out = {}
    for name, svc in data.items():
        what = f"${SANDBOX_SERVICES_ENV}[{name!r}]"
        if not _SERVICE_NAME.match(str(name)):
            raise UserError(f"{what}: a service name is a lower-case DNS label (e.g. ags-shanghai)")
        if (
            not isinstance(svc, dict)
            or set(svc) - {"domain", "secret", "key", "capacity"}
            or not {"domain", "secret"} <= set(svc)
        ):
            raise UserError(f"{what}: expected {{domain, secret[, key, capacity]}}, e.g. {_SERVICES_SHAPE}")
        domain, secret, key = str(svc["domain"]), str(svc["secret"]), str(svc.get("key", "apiKey"))
        if not _HOST.match(domain):
            raise UserError(f"{what}.domain={domain!r}: not a domain name (e.g. ap-shanghai.tencentags.com)")
        if not (_DNS_SUBDOMAIN.match(secret) and len(secret) <= 253):
            raise UserError(f"{what}.secret={secret!r}: not a Kubernetes Secret name")
        if not _SECRET_KEY_RE.match(key):
            raise UserError(f"{what}.key={key!r}: not a Secret data key")
        out[str(name)] = {"domain": domain, "secret": secret, "key": key}
        if "capacity" in svc:  # sandboxes the service holds at once: the pre-flight checks a rollout against it
            capacity = svc["capacity"]
            if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
                raise UserError(f"{what}.capacity={capacity!r}: sandboxes the service holds at once, an integer >= 1")
            out[str(name)]["capacity"] = capacity
    return out


def with_sandbox_service(exp: Experiment, cluster: dict) -> dict:
    """``cluster`` with the code sandbox tool's service (``E2B_DOMAIN`` and the ``E2B_API_KEY`` Secret reference)
    filled in, when the run's tool agent uses that tool; ``cluster`` unchanged otherwise.

    A preset names its service with ``cluster.sandbox_service``, looked up in the deployment's
    ``$PIPELINE_SANDBOX_SERVICES``; a preset that names none gets the deployment's default, ``$PIPELINE_E2B_DOMAIN``
    with the Secret ``sandbox-api-key``. An unknown name, or a run whose pods would have no endpoint, is refused
    here in one line, before a GPU is requested, not in the first rollout.
    """
    from pipeline_steps.tools import uses_code_sandbox

    name = cluster.get("sandbox_service")
    mt = "actor_rollout_ref.rollout.multi_turn."
    enabled = str(exp.verl.get(mt + "enable", False)).lower() in ("true", "1")
    if not enabled or not uses_code_sandbox(exp.verl.get(mt + "tool_config_path") or ""):
        if name is not None:
            raise UserError(
                f"cluster.sandbox_service={name!r}: this preset runs no code sandbox tool; remove the setting"
            )
        return cluster
    env = cluster.get("env") or {}
    if isinstance(env, dict) and {"E2B_DOMAIN", "E2B_API_URL"} & set(env):
        raise UserError(
            "cluster.env: E2B_DOMAIN / E2B_API_URL are the deployment's; name the service with "
            f"cluster.sandbox_service (a key of ${SANDBOX_SERVICES_ENV}) instead"
        )
    if any(isinstance(s, dict) and s.get("env") == "E2B_API_KEY" for s in cluster.get("secrets") or []):
        raise UserError(
            "cluster.secrets: E2B_API_KEY comes with the sandbox service (its Secret is named in "
            f"${SANDBOX_SERVICES_ENV}, or sandbox-api-key for ${SANDBOX_DOMAIN_ENV}); remove it from the preset"
        )
    if name is not None:
        services = sandbox_services()
        if name not in services:
            known = ", ".join(sorted(services)) or "none"
            raise UserError(
                f"cluster.sandbox_service={name!r}: not a sandbox service of this deployment (known: {known}); "
                f"add it to ${SANDBOX_SERVICES_ENV} in the Helm values or name one of those"
            )
        svc = services[name]
        domain, ref = svc["domain"], {"secret": svc["secret"], "key": svc["key"]}
    else:
        domain, ref = settings.get(SANDBOX_DOMAIN_ENV) or "", SANDBOX_KEY_SECRET
        if not domain:
            raise UserError(
                f"the code sandbox tool needs its sandbox service: set ${SANDBOX_DOMAIN_ENV} (Helm values) to your "
                f"sandbox-manager's domain, or name a service of ${SANDBOX_SERVICES_ENV} in cluster.sandbox_service"
            )
        if not _HOST.match(domain):
            raise UserError(f"${SANDBOX_DOMAIN_ENV}={domain!r}: not a domain name (e.g. sandbox.example.com)")
    out = dict(cluster)
    out["env"] = {**env, "E2B_DOMAIN": domain}
    out["secrets"] = [*(cluster.get("secrets") or []), {"env": "E2B_API_KEY", **ref}]
    return out


# -- entrypoint ---------------------------------------------------------------------------------------


def _to_pod(value, key: str, mounts: MountMap):
    """Store URIs inside an override value -> pod paths on the bucket mounts."""
    if isinstance(value, list):
        return [_to_pod(v, key, mounts) for v in value]
    if isinstance(value, str):
        parts = split_uri(value)
        if parts and (parts[0] in SCHEMES or mounts.find(value)):
            try:
                return mounts.to_pod_path(value)
            except UserError as exc:
                raise UserError(f"{key}: {exc}") from None
    return value


def entrypoint_argv(exp: Experiment, mounts: MountMap, forced: dict) -> list[str]:
    """``python3 -m pipeline_steps.training.verl_main key=value ...``: the experiment's overrides, store URIs mapped
    to pod paths, then the keys the cluster backend forces (applied last, so they win)."""
    verl = {k: _to_pod(v, k, mounts) for k, v in exp.verl.items() if k not in forced}
    verl.update(forced)
    return MAIN_PPO + Experiment(exp.name, exp.spec, verl).overrides()


def join_argv(argv: list[str]) -> str:
    """One shell-safe string: every element quoted, so no value can leave its argument."""
    return " ".join(shlex.quote(str(a)) for a in argv)


# -- the RayJob -------------------------------------------------------------------------------------


_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def training_image(cluster: dict) -> str:
    """The deployment's training image (``$PIPELINE_TRAIN_IMAGE``, else the preset's ``cluster.image``), pinned.

    The image is the one a deployment built from ``k8s/docker/Dockerfile.train`` and pushed to its own registry, so
    no shipped preset names one. A moving tag (``:latest``, or none) would change CUDA, torch and vLLM under a run
    without notice, so only a digest or an exact tag is taken.

    :raises UserError: one line saying what to set
    """
    image = settings.get(IMAGE_ENV) or cluster.get("image")
    what = f"${IMAGE_ENV}" if settings.get(IMAGE_ENV) else "cluster.image"
    if not image:
        raise UserError(
            f"no training image: set ${IMAGE_ENV} (or cluster.image) to the image built from "
            "k8s/docker/Dockerfile.train, pinned by digest or an exact tag"
        )
    if not isinstance(image, str) or any(c.isspace() for c in image):
        raise UserError(f"{what}={image!r}: not an image reference")
    name, _, digest = image.partition("@")
    if digest:
        if not _DIGEST.fullmatch(digest):
            raise UserError(f"{what}={image!r}: the digest must be sha256:<64 hex digits>")
        return image
    tag = name.rsplit("/", 1)[-1].partition(":")[2]
    if not tag or tag == "latest":
        raise UserError(f"{what}={image!r}: a moving tag; pin the image by digest (@sha256:...) or an exact tag")
    return image


def build_rayjob(
    exp: Experiment,
    *,
    dag_id: str,
    run_id: str,
    task_id: str,
    namespace: str = "default",
    mounts: MountMap,
    entrypoint: list[str] | None = None,
    job_kind: str = "train",
    cluster: dict | None = None,
) -> dict:
    """The RayJob (a dict) for ``exp``, filled into ``k8s/templates/rayjob.yaml``.

    :param exp: the experiment; ``exp.verl['trainer.default_local_dir']`` must be the run's checkpoint
        store URI when ``entrypoint`` is None (``<run_dir>/checkpoints``, the run directory of
        :func:`pipeline_steps.planning.plan.plan`)
    :param dag_id: Airflow DAG id (name, labels, annotations)
    :param run_id: Airflow run id
    :param task_id: Airflow task id
    :param namespace: Kubernetes namespace of the RayJob
    :param mounts: bucket PVC mounts; store URIs in the config become paths under them
    :param entrypoint: argv to run instead of verl's ``main_ppo`` (for example the evaluate step);
        every element is shell-quoted
    :param job_kind: ``train`` or another kind (part of the name; a label)
    :param cluster: the ``cluster`` section to render instead of the preset's (the preset with deployment settings,
        such as an MLflow connection's server; the experiment's digest stays the preset's)
    :raises UserError: one line naming the bad setting
    """
    if not _DNS_SUBDOMAIN.match(namespace) or len(namespace) > 63:
        raise UserError(f"--namespace {namespace!r}: not a Kubernetes namespace name")
    cluster = (exp.spec.get("cluster") if cluster is None else cluster) or {}
    if not isinstance(cluster, dict):
        raise UserError("experiment: 'cluster' must be a mapping")
    c = _cluster_settings(exp, cluster)
    _check_node_settings_fit(c, mounts)
    cluster = with_sandbox_service(exp, cluster)
    plain_env = _plain_env(cluster)
    env_vars = {"PYTHONUNBUFFERED": "1", **plain_env, **_ray_env(cluster)}
    ray_start = _ray_start_params(cluster)
    argv, annotations = _job_argv(exp, mounts, entrypoint, env_vars)

    name = rayjob_name(dag_id, run_id, task_id, job_kind)
    job = load_template()
    _fill_metadata(job["metadata"], exp, name, namespace, dag_id, run_id, task_id, job_kind, c.queue, annotations)
    spec = job["spec"]
    _fill_job_spec(spec, name, argv, env_vars, c)
    volumes, volume_mounts = mounts.volumes()
    # cluster.env also goes into the containers: NCCL/gIB settings and LD_LIBRARY_PATH must be there when Ray starts
    container_env = [{"name": k, "value": v} for k, v in plain_env.items()] + _secret_env(cluster)
    pod_annotations = mounts.pod_annotations()
    head_tpl = spec["rayClusterSpec"]["headGroupSpec"]["template"]
    _fill_head_group(head_tpl, c, container_env, volumes, volume_mounts, pod_annotations)
    group = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    _fill_worker_group(group, c, ray_start, container_env, volumes, volume_mounts, pod_annotations)
    return job


@dataclasses.dataclass(frozen=True)
class _ClusterSettings:
    """The ``cluster`` section's settings, validated (``cluster.env``, secrets and Ray settings are read apart)."""

    nnodes: int
    gpus: int
    image: str
    account: str
    head: dict
    worker: dict
    deadline: int
    ttl: int
    tolerations: list
    node_selector: dict
    pull_secrets: list
    worker_annotations: dict
    security: dict | None
    host_paths: dict
    queue: object


def _cluster_settings(exp: Experiment, cluster: dict) -> _ClusterSettings:
    """Validate the ``cluster`` section's sizes, image, account, scheduling and pod settings (in this order: the
    first bad one is the error)."""
    nnodes = _int(exp.verl.get("trainer.nnodes", cluster.get("nnodes", 1)), "trainer.nnodes", 1)
    gpus = _int(exp.verl.get("trainer.n_gpus_per_node", cluster.get("gpus_per_node", 0)), "trainer.n_gpus_per_node", 1)
    image = training_image(cluster)
    account = settings.get(SERVICE_ACCOUNT_ENV) or cluster.get("service_account") or "default"
    if not (_DNS_SUBDOMAIN.match(str(account)) and len(str(account)) <= 253):
        raise UserError(f"cluster.service_account={account!r}: not a Kubernetes ServiceAccount name")
    head = _resources(cluster.get("head"), "cluster.head", {"cpu": "8", "memory": "32Gi"})
    worker = _resources(cluster.get("worker"), "cluster.worker", {"cpu": "32", "memory": "256Gi", "shm": "64Gi"})
    deadline = _int(cluster.get("active_deadline_seconds", 86400), "cluster.active_deadline_seconds", 1)
    ttl = _int(cluster.get("ttl_seconds_after_finished", 600), "cluster.ttl_seconds_after_finished", 0)
    tolerations = cluster.get("tolerations") or []
    node_selector = cluster.get("node_selector") or {}
    if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
        raise UserError("cluster.tolerations: expected a list of Kubernetes tolerations")
    if not isinstance(node_selector, dict):
        raise UserError("cluster.node_selector: expected a mapping of node label to value")
    pull_secrets = cluster.get("image_pull_secrets") or []
    if not isinstance(pull_secrets, list) or not all(
        isinstance(n, str) and _DNS_SUBDOMAIN.match(n) and len(n) <= 253 for n in pull_secrets
    ):
        raise UserError("cluster.image_pull_secrets: expected a list of Secret names (private registry logins)")
    worker_annotations = cluster.get("worker_annotations") or {}
    if not isinstance(worker_annotations, dict) or not all(isinstance(k, str) for k in worker_annotations):
        raise UserError("cluster.worker_annotations: expected a mapping of annotation to value (GPU pods only)")
    security = cluster.get("security_context")
    if security is not None and not isinstance(security, dict):
        raise UserError("cluster.security_context: expected a Kubernetes container securityContext mapping")
    host_paths = cluster.get("worker_host_paths") or {}
    if not isinstance(host_paths, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k.startswith("/") and v.startswith("/") and ".." not in k + v
        for k, v in host_paths.items()
    ):
        raise UserError(
            "cluster.worker_host_paths: expected a mapping of container path to node path, both absolute "
            "(e.g. /usr/local/gib: /home/kubernetes/bin/gib)"
        )
    queue = cluster.get("kueue_queue")
    if queue is not None and not (_DNS_SUBDOMAIN.match(str(queue)) and len(str(queue)) <= 63):
        raise UserError(f"cluster.kueue_queue={queue!r}: not a Kueue LocalQueue name")
    return _ClusterSettings(
        nnodes,
        gpus,
        image,
        str(account),
        head,
        worker,
        deadline,
        ttl,
        tolerations,
        node_selector,
        pull_secrets,
        worker_annotations,
        security,
        host_paths,
        queue,
    )


# Node-specific settings that only one cloud's nodes have: (setting, how to recognise it) -> cloud. GKE: its node labels
# and RDMA network annotations, and the COS node layout /home/kubernetes/bin (NVIDIA libraries, the gIB NCCL plugin);
# ACK: Alibaba Cloud's node labels and pod annotations. The cloud of the mounts is the scheme of their buckets.
_NODE_MARKS = {
    "gke": (("cloud.google.com/", "networking.gke.io/", "gke.io/"), ("/home/kubernetes/",)),
    "ack": (("alibabacloud.com/", "aliyun.com/", "k8s.aliyun.com/"), ()),
}
_MOUNT_CLOUDS = {"gs": "gke", "oss": "ack"}


def _check_node_settings_fit(c: _ClusterSettings, mounts: MountMap) -> None:
    """Refuse, in one line, node-specific settings of another cloud than the one the mounts belong to (the GKE-only
    32B preset, its gIB host paths and RDMA annotations, rendered with ACK's mounts would never schedule or start)."""
    mount_clouds = {_MOUNT_CLOUDS.get((split_uri(m.uri) or ("",))[0]) for m in mounts.mounts} - {None}
    if len(mount_clouds) != 1:
        return  # no cloud bucket mounted (a local test store), or a mix: nothing to compare with
    (cloud,) = mount_clouds
    found = []
    for what, keys in (
        ("cluster.worker_annotations", list(c.worker_annotations)),
        ("cluster.node_selector", [str(k) for k in c.node_selector]),
        ("cluster.worker_host_paths", list(c.host_paths.values())),
    ):
        for key in keys:
            for other, (prefixes, paths) in _NODE_MARKS.items():
                label = key.split("/", 1)[0] + "/" if "/" in key and not key.startswith("/") else ""
                marked = any(label.endswith(p) for p in prefixes) or any(key.startswith(p) for p in paths)
                if other != cloud and marked:
                    found.append((other, f"{what} {key}"))
    if found:
        other = found[0][0]
        buckets = ", ".join(sorted(m.uri for m in mounts.mounts))
        raise UserError(
            f"{found[0][1]}{' (and ' + str(len(found) - 1) + ' more)' if len(found) > 1 else ''} is for "
            f"{other.upper()} nodes, but the mounts ({buckets}) are {cloud.upper()}'s: render this preset with "
            f"k8s/overlays/{other}/mounts.json as $PIPELINE_MOUNTS, or use a preset made for {cloud.upper()}"
        )


def _job_argv(exp: Experiment, mounts: MountMap, entrypoint: list[str] | None, env_vars: dict) -> tuple[list, dict]:
    """(argv, annotations): the given ``entrypoint``, or verl's ``main_ppo`` with the run's derived locations
    (checkpoints, metrics, rollouts, TensorBoard; their variables are added to ``env_vars``)."""
    annotations = {}
    if entrypoint is None:
        ckpt = exp.verl.get("trainer.default_local_dir")
        if not isinstance(ckpt, str) or split_uri(ckpt) is None:
            raise UserError(
                f"trainer.default_local_dir={ckpt!r}: the cluster backend needs the run's checkpoint store URI "
                "(render-rayjob --checkpoint-uri URI, or the train task derives it); it must be on a mounted bucket"
            )
        ckpt_pod = mounts.to_pod_path(ckpt)
        env_vars["VERL_FILE_LOGGER_PATH"] = mounts.to_pod_path(metrics_uri(ckpt))
        derived = {"trainer.default_local_dir": ckpt_pod, "trainer.resume_mode": "auto"}
        if not exp.verl.get("trainer.rollout_data_dir"):  # a preset's or the form's own directory wins
            derived["trainer.rollout_data_dir"] = mounts.to_pod_path(rollouts_uri(ckpt))
        argv = entrypoint_argv(exp, mounts, derived)
        annotations["checkpoint-uri"] = ckpt
        if "tensorboard" in tracking_run.loggers(exp.verl.get("trainer.logger")):
            # verl's default is tensorboard_log/<project>/<experiment> under the job's working directory, which
            # goes with the pod; on the mount the event files stay in the store with the run
            env_vars["TENSORBOARD_DIR"] = mounts.to_pod_path(tensorboard_uri(ckpt))
            annotations["tensorboard-uri"] = tensorboard_uri(ckpt)
    else:
        if (
            not isinstance(entrypoint, (list, tuple))
            or not entrypoint
            or not all(isinstance(a, str) for a in entrypoint)
        ):
            raise UserError("entrypoint: expected a non-empty list of strings (argv)")
        argv = list(entrypoint)
    return argv, annotations


def _fill_metadata(
    md: dict, exp: Experiment, name: str, namespace: str, dag_id, run_id, task_id, job_kind, queue, annotations: dict
) -> None:
    """Name, namespace, the DAG run's labels (and the Kueue queue), the run's annotations."""
    md["name"], md["namespace"] = name, namespace
    md["labels"].update(
        {
            LABEL_KIND: label_value(job_kind),
            LABEL_DAG: label_value(dag_id),
            LABEL_RUN: label_value(run_id),
            LABEL_TASK: label_value(task_id),
        }
    )
    if queue:
        md["labels"][KUEUE_LABEL] = str(queue)
    annotations = {
        "dag-id": dag_id,
        "run-id": run_id,
        "task-id": task_id,
        "experiment": exp.name,
        "experiment-digest": exp.digest(),
        **annotations,
    }
    md["annotations"] = {ANNOTATION_PREFIX + k: str(v) for k, v in annotations.items()}


def _fill_job_spec(spec: dict, name: str, argv: list[str], env_vars: dict, c: _ClusterSettings) -> None:
    """The job's id, entrypoint, Ray runtime env, deadline, cleanup and token authentication."""
    spec["jobId"] = name
    spec["entrypoint"] = join_argv(argv)
    spec["runtimeEnvYAML"] = yaml.safe_dump({"env_vars": env_vars}, sort_keys=True, default_flow_style=False)
    spec["activeDeadlineSeconds"] = c.deadline
    spec["ttlSecondsAfterFinished"] = c.ttl
    auth = spec["rayClusterSpec"].setdefault("authOptions", {})
    auth["mode"] = "token"  # never rendered without: the template's value, kept even if the template is edited
    if secret := settings.get(RAY_AUTH_SECRET_ENV):
        if not (_DNS_SUBDOMAIN.match(secret) and len(secret) <= 253):
            raise UserError(f"${RAY_AUTH_SECRET_ENV}={secret!r}: not a Kubernetes Secret name")
        auth["secretName"] = secret


def _fill_head_group(
    head_tpl: dict, c: _ClusterSettings, container_env: list, volumes: list, volume_mounts: list, pod_annotations
) -> None:
    """The head pod: image, account, resources, env, security context, bucket volumes, pull secrets."""
    head_tpl["metadata"]["annotations"] = dict(pod_annotations)
    head_pod = head_tpl["spec"]
    head_pod["serviceAccountName"] = c.account
    hc = head_pod["containers"][0]
    hc["image"] = c.image
    hc["resources"] = {
        "requests": {"cpu": c.head["cpu"], "memory": c.head["memory"]},
        "limits": {"cpu": c.head["cpu"], "memory": c.head["memory"]},
    }
    hc["env"] = copy.deepcopy(container_env)
    if c.security:
        hc["securityContext"] = copy.deepcopy(c.security)
    hc["volumeMounts"] = copy.deepcopy(volume_mounts)
    head_pod["volumes"] = copy.deepcopy(volumes)
    if c.pull_secrets:
        head_pod["imagePullSecrets"] = [{"name": n} for n in c.pull_secrets]


def _fill_worker_group(
    group: dict,
    c: _ClusterSettings,
    ray_start: dict,
    container_env: list,
    volumes: list,
    volume_mounts: list,
    pod_annotations,
) -> None:
    """The GPU worker group: replicas, Ray start parameters, annotations, the pod and its container."""
    group["replicas"] = group["minReplicas"] = group["maxReplicas"] = c.nnodes
    group["rayStartParams"] = {**group.get("rayStartParams", {}), **ray_start}
    group["template"]["metadata"]["annotations"] = {
        **dict(pod_annotations),
        **{k: str(v) for k, v in c.worker_annotations.items()},  # e.g. GKE's RDMA network interfaces
    }
    wpod = group["template"]["spec"]
    if c.pull_secrets:
        wpod["imagePullSecrets"] = [{"name": n} for n in c.pull_secrets]
    wpod["serviceAccountName"] = c.account
    wc = wpod["containers"][0]
    wc["image"] = c.image
    res = {"cpu": c.worker["cpu"], "memory": c.worker["memory"], "nvidia.com/gpu": c.gpus}
    wc["resources"] = {"requests": dict(res), "limits": dict(res)}
    wc["env"] = copy.deepcopy(container_env)
    if c.security:
        wc["securityContext"] = copy.deepcopy(c.security)
    _worker_volumes(wpod, wc, c, volumes, volume_mounts)
    wpod["tolerations"] = copy.deepcopy(c.tolerations)
    wpod["nodeSelector"] = {str(k): str(v) for k, v in c.node_selector.items()}


def _worker_volumes(wpod: dict, wc: dict, c: _ClusterSettings, volumes: list, volume_mounts: list) -> None:
    """The template's shared memory (sized), the bucket volumes and the read-only host paths."""
    wc["volumeMounts"] = [m for m in wc["volumeMounts"] if m["name"] == "dshm"] + copy.deepcopy(volume_mounts)
    wpod["volumes"] = [v for v in wpod["volumes"] if v["name"] == "dshm"] + copy.deepcopy(volumes)
    for v in wpod["volumes"]:
        if v["name"] == "dshm":
            v["emptyDir"]["sizeLimit"] = c.worker["shm"]
    for i, (mount_path, node_path) in enumerate(sorted(c.host_paths.items())):  # read-only: libraries and plugins
        wpod["volumes"].append({"name": f"host-{i}", "hostPath": {"path": node_path, "type": "Directory"}})
        wc["volumeMounts"].append({"name": f"host-{i}", "mountPath": mount_path, "readOnly": True})


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (runtimeEnvYAML) as literal blocks, where YAML allows it."""


def _str(dumper, data: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _str)


def to_yaml(job: dict) -> str:
    return yaml.dump(job, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1 << 16)
