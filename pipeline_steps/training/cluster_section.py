"""The validation of a preset's ``cluster:`` section: sizes, image, account, scheduling, pod settings, the container
and Ray environments and the Secret references, each refused in one line naming the setting.

:func:`cluster_settings` reads the section into :class:`ClusterSettings`; :func:`check_node_settings_fit` refuses
node settings of another cloud than the mounts'; :func:`plain_env`, :func:`ray_env`, :func:`ray_start_params` and
:func:`secret_env` read ``cluster.env``, ``cluster.ray_env``, ``cluster.worker_ray_start_params`` and
``cluster.secrets``. The RayJob rendering (:mod:`pipeline_steps.training.rayjob_manifest`) fills them in.
"""

from __future__ import annotations

import dataclasses
import re

from pipeline_steps import settings
from pipeline_steps.errors import UserError
from pipeline_steps.training.experiment import Experiment
from pipeline_steps.training.mounts import MountMap, split_uri

IMAGE_ENV = settings.TRAIN_IMAGE
SERVICE_ACCOUNT_ENV = settings.RAY_SERVICE_ACCOUNT

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY|API_KEY", re.I)
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")


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


def secret_env(cluster: dict) -> list[dict]:
    """Container env entries that read secrets by name (``cluster.secrets``); never a literal value."""
    out = []
    for i, s in enumerate(cluster.get("secrets") or []):
        what = f"cluster.secrets[{i}]"
        if not isinstance(s, dict) or set(s) - {"env", "secret", "key", "optional"}:
            raise UserError(
                f"{what}: expected {{env, secret, key[, optional]}} naming a Kubernetes Secret, never a value"
            )
        env, secret, key = str(s.get("env", "")), str(s.get("secret", "")), str(s.get("key", ""))
        if not ENV_NAME.match(env):
            raise UserError(f"{what}.env={env!r}: not an environment variable name")
        if not DNS_SUBDOMAIN.match(secret):
            raise UserError(f"{what}.secret={secret!r}: not a Kubernetes Secret name (lower-case DNS name)")
        if not SECRET_KEY.match(key):
            raise UserError(f"{what}.key={key!r}: not a Secret data key")
        ref = {"name": secret, "key": key}
        if "optional" in s:
            if not isinstance(s["optional"], bool):
                raise UserError(f"{what}.optional must be true or false")
            ref["optional"] = s["optional"]
        out.append({"name": env, "valueFrom": {"secretKeyRef": ref}})
    return out


def ray_env(cluster: dict) -> dict:
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
        if not ENV_NAME.match(str(k)) or SECRETISH.search(str(k)):
            raise UserError(f"cluster.ray_env: {k!r} is not a non-secret environment variable name")
        out[str(k)] = str(v)
    return out


_RAY_START_KEYS = {"num-cpus", "num-gpus", "memory", "object-store-memory"}


def ray_start_params(cluster: dict) -> dict:
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


def plain_env(cluster: dict) -> dict:
    env = cluster.get("env") or {}
    if not isinstance(env, dict):
        raise UserError("cluster.env: expected a mapping of NAME: value (non-secret settings only)")
    out = {}
    for k, v in env.items():
        if not ENV_NAME.match(str(k)):
            raise UserError(f"cluster.env: {k!r} is not an environment variable name")
        if SECRETISH.search(str(k)):
            raise UserError(
                f"cluster.env.{k}: looks like a secret; reference a Kubernetes Secret in cluster.secrets instead"
            )
        out[str(k)] = str(v)
    return out


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


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
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


def cluster_settings(exp: Experiment, cluster: dict) -> ClusterSettings:
    """Validate the ``cluster`` section's sizes, image, account, scheduling and pod settings (in this order: the
    first bad one is the error)."""
    nnodes = _int(exp.verl.get("trainer.nnodes", cluster.get("nnodes", 1)), "trainer.nnodes", 1)
    gpus = _int(exp.verl.get("trainer.n_gpus_per_node", cluster.get("gpus_per_node", 0)), "trainer.n_gpus_per_node", 1)
    image = training_image(cluster)
    account = settings.get(SERVICE_ACCOUNT_ENV) or cluster.get("service_account") or "default"
    if not (DNS_SUBDOMAIN.match(str(account)) and len(str(account)) <= 253):
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
        isinstance(n, str) and DNS_SUBDOMAIN.match(n) and len(n) <= 253 for n in pull_secrets
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
    if queue is not None and not (DNS_SUBDOMAIN.match(str(queue)) and len(str(queue)) <= 63):
        raise UserError(f"cluster.kueue_queue={queue!r}: not a Kueue LocalQueue name")
    return ClusterSettings(
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


def check_node_settings_fit(c: ClusterSettings, mounts: MountMap) -> None:
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
