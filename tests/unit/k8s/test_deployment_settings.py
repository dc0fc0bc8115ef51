"""The Helm values, as a deployment reads them, fit together: scheduled runs train a cluster preset on KubeRay
against the bucket, the gpu pool can hold a task's slots and counts deferred tasks, the images install the package.
(Read from the files; no cluster runs here.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
VALUES = ROOT / "k8s" / "airflow" / "values.yaml"


def _env() -> dict[str, str]:
    return {e["name"]: e.get("value") for e in yaml.safe_load(VALUES.read_text())["env"]}


def test_scheduled_runs_train_a_cluster_preset_on_kuberay_against_the_mounted_bucket():
    from pipeline_steps.training import experiment
    from pipeline_steps.training.mounts import MountMap

    env = _env()
    preset = experiment.load(env["PIPELINE_DEFAULT_EXPERIMENT"])
    assert preset.spec.get("backend") != "local" and env["PIPELINE_DEFAULT_BACKEND"] == "kuberay"
    store = env["PIPELINE_STORE_URI"]
    assert store.startswith(("oss://", "gs://"))
    mounts = MountMap.from_config(yaml.safe_load(env["PIPELINE_MOUNTS"]), source="PIPELINE_MOUNTS")
    assert mounts.find(store), "the store is not on a bucket mount: a kuberay render would fail"


def test_the_gpu_pool_holds_a_tasks_slots_and_counts_deferred_tasks():
    text = VALUES.read_text()
    m = re.search(r"airflow pools set gpu (\d+) \"[^\"]*\"( --include-deferred)?", text)
    assert m, "the values must say how the gpu pool is created"
    assert int(m.group(1)) >= int(_env()["PIPELINE_GPU_SLOTS"]), "a task would ask for more slots than the pool"
    assert m.group(2), (
        "without --include-deferred a deferred train frees its slots (tests/e2e/test_postgres_profile.py)"
    )
    guide = (ROOT / "docs" / "cluster.md").read_text()
    assert m.group(0) in guide  # the deployment guide tells the same command


def test_both_images_install_the_package_not_a_path():
    for name in ("Dockerfile.airflow", "Dockerfile.train"):
        text = (ROOT / "k8s" / "docker" / name).read_text()
        assert re.search(r"pip install --no-cache-dir --no-deps /opt/\S+", text), name
        assert "PYTHONPATH" not in re.sub(r"#.*", "", text), name
