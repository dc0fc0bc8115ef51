"""Rendering a preset's RayJob as the pipeline does (tests/unit/pipeline_steps/training/test_render_rayjob.py and the
tests that check presets and guides against the cluster): the shipped ACK and GKE mount maps, the committed examples'
settings, the keys the pipeline derives, and the deployment's Helm values (k8s/airflow/values.yaml)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from pipeline_steps.planning.plan import run_key
from pipeline_steps.training import experiment, sandbox_services
from pipeline_steps.training.mounts import MountMap
from pipeline_steps.training.rayjob_manifest import build_rayjob

ROOT = Path(__file__).resolve().parents[2]  # the repository

ACK = MountMap.from_config(json.loads((ROOT / "k8s/overlays/ack/mounts.json").read_text()))


GKE = MountMap.from_config(json.loads((ROOT / "k8s/overlays/gke/mounts.json").read_text()))


RUN = "manual__2026-01-01T00:00:00+00:00"


# (preset, mounts, bucket) for the committed examples in k8s/examples/
EXAMPLES = [
    ("gsm8k_qwen2_5_3b", ACK, "oss://verl-store", "gsm8k"),
    ("dapo_qwen3_4b", ACK, "oss://verl-store", "dapo_math"),
    ("gsm8k_tool_agent_qwen2_5_3b", ACK, "oss://verl-store", "gsm8k"),
    ("dapo_retool_qwen3_4b", ACK, "oss://verl-store", "dapo_math"),
    ("gsm8k_qwen2_5_32b", GKE, "gs://verl-store", "gsm8k"),
    ("gspo", ACK, "oss://verl-store", "gsm8k"),
    ("geo3k_qwen2_5_vl_7b", ACK, "oss://verl-store", "geometry3k"),
    ("geo3k_qwen2_5_vl_3b", ACK, "oss://verl-store", "geometry3k"),
]


# and, for the code sandbox tool, its sandbox service (sandbox-manager's domain on ACK): the seed-000 preset names none
SANDBOX_DOMAIN = "sandbox.example.com"


def derived(bucket: str, preset: str, dataset: str) -> dict:
    exp = experiment.load(preset)
    model = exp.spec["model"]["source"]
    return {
        "data.train_files": [f"{bucket}/datasets/{dataset}/rev1/0123abcd/train.parquet"],
        "data.val_files": [f"{bucket}/datasets/{dataset}/rev1/0123abcd/test.parquet"],
        "actor_rollout_ref.model.path": f"{bucket}/models/{model}/main",
        "trainer.default_local_dir": f"{bucket}/runs/{exp.name}/{run_key(RUN)}/checkpoints",  # as the plan lays out
    }


def render(
    preset="gsm8k_qwen2_5_3b", mounts=ACK, bucket="oss://verl-store", dataset="gsm8k", overrides=(), pipeline=None, **kw
):
    """``pipeline``: derived keys the pipeline sets differently (users cannot override them)."""
    keys = {**derived(bucket, preset, dataset), **(pipeline or {})}
    exp = experiment.load(preset, overrides=list(overrides), derived=keys)
    args = dict(dag_id="verl_grpo_pipeline", run_id=RUN, task_id="train", namespace="verl-pipeline", mounts=mounts)
    args.update(kw)
    # the deployment's sandbox services as its Helm values set them, unless the test sets its own
    deployment = {
        sandbox_services.SANDBOX_DOMAIN_ENV: SANDBOX_DOMAIN,
        **helm_env(sandbox_services.SANDBOX_SERVICES_ENV),
    }
    added = [k for k in deployment if k not in os.environ]
    os.environ.update({k: deployment[k] for k in added})
    try:
        return exp, build_rayjob(exp, **args)
    finally:
        for k in added:
            del os.environ[k]


def helm_env(*names: str) -> dict[str, str]:
    """Values of ``env:`` entries in the shipped Helm values (k8s/airflow/values.yaml)."""
    values = yaml.safe_load((ROOT / "k8s" / "airflow" / "values.yaml").read_text())
    return {e["name"]: e["value"] for e in values["env"] if e["name"] in names}
