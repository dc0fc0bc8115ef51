"""Shared fixtures: an offline Hugging Face cache built from the shipped fixtures, the tiny local model, and the
Kubernetes API stand-in behind an Airflow connection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests.storage_servers"]  # the object-store server fixtures

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache (HF_HUB_CACHE) holding every fixture repository; the Hub itself is unreachable here."""
    from pipeline_steps.local import offline_hub as local_hub

    cache = tmp_path_factory.mktemp("hf-cache")
    index = local_hub.build_cache(local_hub.FIXTURES, cache)
    return {"path": cache, "index": index}


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache["path"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from pipeline_steps.local import tiny_model

    # without the format warm-up: the random-weight model the trainer and step tests were written against (its
    # responses vary in form, which their rewards rely on); tests/test_learning.py builds the warmed-up default
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model", format_warmup_steps=0)


K8S_CONN_ID = "k8s_standin"
K8S_NAMESPACE = "training"
RAYJOB_CRD = ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml"


@pytest.fixture
def k8s_api(tmp_path, monkeypatch):
    """tests/k8s_api_stand_in.py's API server (RayJobs checked against the vendored KubeRay v1.7.0 CRD),
    reached through the Airflow connection ``k8s_standin`` (namespace ``training``)."""
    from tests.k8s_api_stand_in import StandIn

    api = StandIn(crd_file=RAYJOB_CRD)
    api.start()
    kube_config = api.kube_config(tmp_path / "kubeconfig", namespace=K8S_NAMESPACE)
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{K8S_CONN_ID.upper()}",
        json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kube_config), "namespace": K8S_NAMESPACE}}
        ),
    )
    try:
        yield api
    finally:
        api.stop()


def run_step(*args, env=None, check=None, cwd=ROOT):
    """Run ``python -m pipeline_steps ...`` as a user would; returns (exit code, summary dict, stderr)."""
    full_env = dict(os.environ, **(env or {}))
    p = subprocess.run(
        [sys.executable, "-m", "pipeline_steps", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=600,
    )
    lines = p.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else None
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}, stderr:\n{p.stderr[-3000:]}"
    return p.returncode, summary, p.stderr


def assert_refused(code: int, err: str, *needles: str) -> None:
    """A step refused bad input as users should see it: exit 2, one stderr line naming it, no traceback."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
