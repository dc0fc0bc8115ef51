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

The ``cluster`` section is validated by :mod:`pipeline_steps.training.cluster_section`, the code sandbox tool's
service comes from :mod:`pipeline_steps.training.sandbox_services`; this module fills the template with them.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import shlex
from pathlib import Path

import yaml

from pipeline_steps import settings, tracking_run
from pipeline_steps.constants import RAYJOB_NAME_MAX
from pipeline_steps.errors import UserError
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.store.store_uri import SCHEMES
from pipeline_steps.training import cluster_section
from pipeline_steps.training.cluster_section import DNS_SUBDOMAIN, ClusterSettings
from pipeline_steps.training.derived_keys import derived_env, derived_keys
from pipeline_steps.training.experiment import Experiment
from pipeline_steps.training.mounts import MountMap, split_uri
from pipeline_steps.training.sandbox_services import with_sandbox_service

TEMPLATE = Path(__file__).with_name("rayjob_template.yaml")  # package data; k8s/templates/rayjob.yaml links here
LABEL_DAG, LABEL_RUN, LABEL_TASK = "dag_id", "run_id", "task_id"  # as the cncf-kubernetes provider labels pods
LABEL_KIND = "app.kubernetes.io/component"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ANNOTATION_PREFIX = "verl-grpo-pipeline/"
RAY_AUTH_SECRET_ENV = settings.RAY_AUTH_SECRET  # a Secret holding the clusters' Ray token (else KubeRay makes one)
MAIN_PPO = ["python3", "-m", "pipeline_steps.training.verl_main"]  # verl.trainer.main_ppo, history kept

_LABEL_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


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


# -- the template -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _template_text() -> str:
    return TEMPLATE.read_text(encoding="utf-8")


def load_template() -> dict:
    """A fresh copy of the RayJob template."""
    return yaml.safe_load(_template_text())


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
    if not DNS_SUBDOMAIN.match(namespace) or len(namespace) > 63:
        raise UserError(f"--namespace {namespace!r}: not a Kubernetes namespace name")
    cluster = (exp.spec.get("cluster") if cluster is None else cluster) or {}
    if not isinstance(cluster, dict):
        raise UserError("experiment: 'cluster' must be a mapping")
    c = cluster_section.cluster_settings(exp, cluster)
    cluster_section.check_node_settings_fit(c, mounts)
    cluster = with_sandbox_service(exp, cluster)
    plain_env = cluster_section.plain_env(cluster)
    env_vars = {"PYTHONUNBUFFERED": "1", **plain_env, **cluster_section.ray_env(cluster)}
    ray_start = cluster_section.ray_start_params(cluster)
    argv, annotations = _job_argv(exp, mounts, entrypoint, env_vars)

    name = rayjob_name(dag_id, run_id, task_id, job_kind)
    job = load_template()
    _fill_metadata(job["metadata"], exp, name, namespace, dag_id, run_id, task_id, job_kind, c.queue, annotations)
    spec = job["spec"]
    _fill_job_spec(spec, name, argv, env_vars, c)
    volumes, volume_mounts = mounts.volumes()
    # cluster.env also goes into the containers: NCCL/gIB settings and LD_LIBRARY_PATH must be there when Ray starts
    container_env = [{"name": k, "value": v} for k, v in plain_env.items()] + cluster_section.secret_env(cluster)
    pod_annotations = mounts.pod_annotations()
    head_tpl = spec["rayClusterSpec"]["headGroupSpec"]["template"]
    _fill_head_group(head_tpl, c, container_env, volumes, volume_mounts, pod_annotations)
    group = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    _fill_worker_group(group, c, ray_start, container_env, volumes, volume_mounts, pod_annotations)
    return job


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
        layout = RunLayout.for_checkpoints(ckpt)  # the run's other locations are beside its checkpoints
        # on the pods, as paths on the bucket mounts; a preset's or the form's own rollout directory wins
        rollouts = not exp.verl.get("trainer.rollout_data_dir")
        derived = derived_keys(layout, rollouts=rollouts, where=mounts.to_pod_path)
        # verl's TensorBoard default is tensorboard_log/<project>/<experiment> under the job's working directory,
        # which goes with the pod; on the mount the event files stay in the store with the run
        tensorboard = "tensorboard" in tracking_run.loggers(exp.verl.get("trainer.logger"))
        env_vars.update(derived_env(layout, tensorboard=tensorboard, where=mounts.to_pod_path))
        argv = entrypoint_argv(exp, mounts, derived)
        annotations["checkpoint-uri"] = layout.checkpoints
        if tensorboard:
            annotations["tensorboard-uri"] = layout.tensorboard
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


def _fill_job_spec(spec: dict, name: str, argv: list[str], env_vars: dict, c: ClusterSettings) -> None:
    """The job's id, entrypoint, Ray runtime env, deadline, cleanup and token authentication."""
    spec["jobId"] = name
    spec["entrypoint"] = join_argv(argv)
    spec["runtimeEnvYAML"] = yaml.safe_dump({"env_vars": env_vars}, sort_keys=True, default_flow_style=False)
    spec["activeDeadlineSeconds"] = c.deadline
    spec["ttlSecondsAfterFinished"] = c.ttl
    auth = spec["rayClusterSpec"].setdefault("authOptions", {})
    auth["mode"] = "token"  # never rendered without: the template's value, kept even if the template is edited
    if secret := settings.get(RAY_AUTH_SECRET_ENV):
        if not (DNS_SUBDOMAIN.match(secret) and len(secret) <= 253):
            raise UserError(f"${RAY_AUTH_SECRET_ENV}={secret!r}: not a Kubernetes Secret name")
        auth["secretName"] = secret


def _fill_head_group(
    head_tpl: dict, c: ClusterSettings, container_env: list, volumes: list, volume_mounts: list, pod_annotations
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
    c: ClusterSettings,
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


def _worker_volumes(wpod: dict, wc: dict, c: ClusterSettings, volumes: list, volume_mounts: list) -> None:
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
