"""RayJobOperators against the Kubernetes API stand-in (the ``k8s_api`` fixture's connection): a minimal RayJob
body of the shape the renderer produces, and an operator that polls fast and writes its metrics and checkpoints under
a test's directory."""

from __future__ import annotations

import shlex
from pathlib import Path

from operators.rayjob_operator import RayJobOperator
from tests.helpers.k8s_connection import K8S_CONN_ID, K8S_NAMESPACE

CONN, NS = K8S_CONN_ID, K8S_NAMESPACE


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


def make_op(name: str, tmp_path: Path, **kw) -> RayJobOperator:
    return RayJobOperator(
        task_id="train",
        rayjob=rayjob_body(name, "/mnt/ckpt/run1"),
        namespace=NS,
        kubernetes_conn_id=CONN,
        poll_interval=0.01,
        metrics_uri=str(tmp_path / "metrics.jsonl"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        **kw,
    )
