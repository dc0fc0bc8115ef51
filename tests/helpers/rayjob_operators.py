"""The product's training operator on the kuberay backend against the Kubernetes API stand-in (the ``k8s_api``
fixture's connection): ``GRPOTrainOperator`` with a shipped preset (``gsm8k_qwen2_5_3b``), its real pre-flight and
its real RayJob render, a run directory on a bucket the Ray pods mount. ``kuberay_deployment`` sets what a cluster
deployment sets (the mounts, the training image); the worker reads the run directory at the mount path, as the pods
see it, since no bucket can be reached from here. And a minimal RayJob body (``rayjob_body``) for the tests of the
hook and of the API server stand-in themselves."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

from airflow.sdk import DAG

from operators.backends import attempt_body
from operators.train import GRPOTrainOperator
from pipeline_steps.training.rayjob_manifest import rayjob_name
from tests.helpers.k8s_connection import K8S_CONN_ID, K8S_NAMESPACE
from tests.helpers.operator_runs import RUN_ID

CONN, NS = K8S_CONN_ID, K8S_NAMESPACE
PRESET = "gsm8k_qwen2_5_3b"
BUCKET = "gs://verl-bucket"
RUN_DIR = f"{BUCKET}/runs/gsm8k/run1"
IMAGE = "registry.example.com/verl-grpo-train@sha256:" + "0" * 64
CONTEXT = {"run_id": RUN_ID}


def read_through_mounts(monkeypatch) -> None:
    """The worker reads a store URI at its path on the bucket mount (``$PIPELINE_MOUNTS``), with the real reader."""
    from operators import progress
    from pipeline_steps.training.mounts import MountMap

    real = progress.read_text
    monkeypatch.setattr(
        progress,
        "read_text",
        lambda uri, *conn: real(MountMap.from_env().to_pod_path(uri) if "://" in uri else uri, *conn),
    )


_PREFLIGHT: dict = {}


def preflight_once(monkeypatch) -> None:
    """The real pre-flight, run once per configuration (experiment digest) in this process and its summary reused:
    it takes seconds, and the RayJob tests run the train task dozens of times on one configuration."""
    from pipeline_steps.training import preflight_checks

    real = preflight_checks.preflight

    def preflight(exp, *, check_store: bool = True, **kwargs) -> dict:
        key = (exp.digest(), check_store)
        if key not in _PREFLIGHT:
            _PREFLIGHT[key] = real(exp, check_store=check_store, **kwargs)
        return copy.deepcopy(_PREFLIGHT[key])

    monkeypatch.setattr(preflight_checks, "preflight", preflight)


def kuberay_deployment(monkeypatch, tmp_path: Path) -> Path:
    """The bucket mounted at ``<tmp_path>/mnt`` and a pinned training image; returns the run directory there."""
    mnt = tmp_path / "mnt"
    monkeypatch.setenv("PIPELINE_MOUNTS", json.dumps([{"uri": BUCKET, "claim": "verl-store", "path": str(mnt)}]))
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", IMAGE)
    read_through_mounts(monkeypatch)
    return mnt / RUN_DIR.removeprefix(BUCKET + "/")


def job_name(dag_id: str, attempt: int = 0) -> str:
    """The RayJob the train task of ``dag_id`` creates for its attempt ``attempt`` (in run ``RUN_ID``)."""
    base = rayjob_name(dag_id, RUN_ID, "train", "train")
    return attempt_body({"metadata": {"name": base}}, base, attempt)["metadata"]["name"]


def train_plan(
    experiment: str, backend: str, store: str, overrides=(), run_dir: str | None = None, save: bool = False
) -> dict:
    """The run's plan as the plan task makes it (the preset read once, the backend resolved), for a train operator.

    :param overrides: appended to the plan's overrides as the plan holds them, without the form's table check (a
        test hands the operator what pre-flight must refuse, or a test-only reward function)
    :param run_dir: the run directory the plan names (default: the plan's own, below ``store``)
    :param save: write ``plan.json`` there (the local backend's ``train-local`` reads the run's plan from it)
    """
    from pipeline_steps.planning.plan import plan as make_plan
    from pipeline_steps.planning.plan_io import save as save_plan

    params = {"experiment": experiment, "backend": backend, "store_uri": store}
    run = make_plan(params, None, RUN_ID, "tests")
    run["overrides"] = [*run["overrides"], *overrides]
    if run_dir:
        run["run_dir"] = str(run_dir).rstrip("/")
    if save:
        save_plan(run)
    return run


def make_op(dag_id: str, **kw) -> GRPOTrainOperator:
    """The train task of DAG ``dag_id`` on the kuberay backend, polling fast (its plan made by :func:`train_plan`;
    ``overrides=`` are added to it)."""
    args = dict(
        task_id="train",
        plan=train_plan(PRESET, "kuberay", BUCKET, kw.pop("overrides", ()), RUN_DIR),
        namespace=NS,
        train_files=[f"{BUCKET}/datasets/gsm8k/train.parquet"],
        val_files=[f"{BUCKET}/datasets/gsm8k/test.parquet"],
        model_path=f"{BUCKET}/models/Qwen/Qwen2.5-3B-Instruct/main",
        run_dir=RUN_DIR,
        check_store=False,
        kubernetes_conn_id=CONN,
        poll_interval=0.01,
    )
    with DAG(dag_id, schedule=None):
        return GRPOTrainOperator(**{**args, **kw})


def rayjob_body(name: str, ckpt: str) -> dict:
    """A minimal RayJob of the shape render_rayjob produces (verl entrypoint with quoted Hydra overrides)."""
    args = [
        "python3",
        "-m",
        "verl.trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"trainer.default_local_dir={ckpt}",
        "trainer.resume_mode=disable",
    ]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "verl-grpo"}},
        "spec": {
            "entrypoint": shlex.join(args),
            "jobId": f"{name}-job",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 60,
            "activeDeadlineSeconds": 3600,
            "rayClusterSpec": {
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [{"name": "ray-head", "image": "verlai/verl:latest"}]}},
                }
            },
        },
    }
