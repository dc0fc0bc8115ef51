"""Each cluster preset, rendered as the deployment renders it, fits the cluster it is shipped for (issue 24, 3-5).

- Node shapes: the GPU worker fits a GPU pool of the preset's overlay (``k8s/overlays/<cloud>/node-pools.yaml``: the
  guides' node shapes), its tolerations cover the pool's NoSchedule taints and its selector matches the pool's labels;
  the head, which has no tolerations, fits the untainted CPU pool and stays under a stated maximum.
- References: every Secret (with its key), PVC and ServiceAccount a rendered job names exists in the overlay or in
  the Secrets list of k8s/secrets/README.md; on the shipped store (``PIPELINE_STORE_URI`` in the Helm values) the
  pods get every setting the store's client reads (pipeline_steps/store/oss.py), since export and evaluate open it.
- Checkpoints: saves x checkpoint size (from the model's parameter count and verl's ``save_contents``) stays under a
  written-bytes budget, and what the bucket keeps (``trainer.max_actor_ckpt_to_keep``) under a kept-bytes budget.
The old presets fail: dapo's 128-CPU / 1000Gi head and worker, gspo without OSS settings, ACK's save_freq=1.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers.render import EXAMPLES, GKE, render

ROOT = Path(__file__).resolve().parents[4]
K8S = ROOT / "k8s"
HEAD_MAX = {"cpu": 16.0, "memory": 64 * 2**30}  # a CPU-only Ray head: verl's driver and Ray's GCS, no training
GIB = 2**30
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}


def qty(value) -> float:
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    return float(m.group(1)) * _UNITS.get(m.group(2), 1)


def cloud_of(mounts) -> str:
    return "gke" if mounts is GKE else "ack"


def pools(cloud: str) -> list[dict]:
    return yaml.safe_load((K8S / "overlays" / cloud / "node-pools.yaml").read_text())["pools"]


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' toleration matching (an empty key with Exists tolerates everything)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and str(t.get("value", "")) == str(taint.get("value", "")):
            return True
    return False


def fits(pod: dict, pool: dict) -> str | None:
    """None when ``pod`` schedules on ``pool``'s nodes, else why not."""
    req = pod["containers"][0]["resources"]["requests"]
    alloc = pool["allocatable"]
    for k, v in req.items():
        if qty(v) > qty(alloc.get(k, 0)):
            return f"{k} {v} > {alloc.get(k, 0)}"
    hard = [t for t in pool["taints"] if t["effect"] in ("NoSchedule", "NoExecute")]
    untolerated = [t["key"] for t in hard if not tolerates(pod.get("tolerations") or [], t)]
    if untolerated:
        return f"taints {untolerated} not tolerated"
    for k, v in (pod.get("nodeSelector") or {}).items():
        if pool["labels"].get(k) != v:
            return f"nodeSelector {k}={v} not on the pool"
    return None


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    from pipeline_steps.training import cluster_section, sandbox_services

    for var in (
        cluster_section.SERVICE_ACCOUNT_ENV,
        "PIPELINE_MOUNTS",
        sandbox_services.SANDBOX_DOMAIN_ENV,
        sandbox_services.SANDBOX_SERVICES_ENV,
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(cluster_section.IMAGE_ENV, "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)


@pytest.mark.parametrize("preset,mounts,bucket,dataset", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_pods_fit_a_node_pool_of_their_overlay(preset, mounts, bucket, dataset):
    _, job = render(preset, mounts, bucket, dataset)
    cluster = job["spec"]["rayClusterSpec"]
    cloud = cloud_of(mounts)
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    why = {p["name"]: fits(worker, p) for p in pools(cloud) if "nvidia.com/gpu" in p["allocatable"]}
    assert None in why.values(), f"{preset}: the GPU worker fits no GPU pool of {cloud}: {why}"
    head = cluster["headGroupSpec"]["template"]["spec"]
    req = head["containers"][0]["resources"]["requests"]
    assert qty(req["cpu"]) <= HEAD_MAX["cpu"] and qty(req["memory"]) <= HEAD_MAX["memory"], f"{preset}: head {req}"
    why = {p["name"]: fits(head, p) for p in pools(cloud) if "nvidia.com/gpu" not in p["allocatable"]}
    assert None in why.values(), f"{preset}: the head fits no CPU pool of {cloud}: {why}"


def documented_secrets() -> dict[str, set[str]]:
    """Secret -> keys, for the verl-pipeline namespace, from k8s/secrets/README.md's table."""
    out: dict[str, set[str]] = {}
    for line in (K8S / "secrets" / "README.md").read_text().splitlines():
        m = re.match(r"^\| `([a-z0-9-]+)` \(`verl-pipeline`\) \| ([^|]+)\|", line)
        if m:
            out.setdefault(m.group(1), set()).update(re.findall(r"`([A-Za-z0-9_.-]+)`", m.group(2)))
    return out


def overlay_objects(cloud: str) -> set[tuple[str, str]]:
    out = set()
    for path in (K8S / "overlays" / cloud).glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "kind" in doc and "metadata" in doc:
                out.add((doc["kind"], doc["metadata"]["name"]))
    return out


def store_settings() -> set[str]:
    """What the OSS store's client reads (handed credentials, else the environment: ``self.setting(...)``), less its
    optional settings. Never empty: a scan that finds nothing would make the pods' check below pass vacuously."""
    text = (ROOT / "pipeline_steps" / "store" / "oss.py").read_text()
    found = set(re.findall(r'(?:os\.environ\.get|self\.setting)\("(OSS_[A-Z_]+)"', text))
    assert found, "pipeline_steps/store/oss.py: no OSS_* setting read; update this scan to how the client reads them"
    return found - {"OSS_SESSION_TOKEN", "OSS_PATH_STYLE"}


@pytest.mark.parametrize("preset,mounts,bucket,dataset", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_everything_a_job_references_exists(preset, mounts, bucket, dataset):
    _, job = render(preset, mounts, bucket, dataset)
    cloud = cloud_of(mounts)
    objects, secrets = overlay_objects(cloud), documented_secrets()
    cluster = job["spec"]["rayClusterSpec"]
    for pod in (cluster["headGroupSpec"]["template"]["spec"], cluster["workerGroupSpecs"][0]["template"]["spec"]):
        assert ("ServiceAccount", pod["serviceAccountName"]) in objects
        for v in pod.get("volumes") or []:
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in objects
            assert "configMap" not in v and "secret" not in v, f"{preset}: volume {v['name']} names no overlay object"
        env = pod["containers"][0].get("env") or []
        for e in env:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                assert ref["name"] in secrets, f"{preset}: Secret {ref['name']} is not in k8s/secrets/README.md"
                assert ref["key"] in secrets[ref["name"]], f"{preset}: Secret {ref['name']} has no key {ref['key']}"
        names = {e["name"] for e in env}
        if cloud == "ack":  # the shipped store, oss://verl-store: export and evaluate open it with the OSS client
            assert store_settings() <= names, f"{preset}: the pods lack {sorted(store_settings() - names)}"


def test_the_shipped_store_is_the_ack_overlay_bucket():
    values = yaml.safe_load((K8S / "airflow" / "values.yaml").read_text())
    store = next(e["value"] for e in values["env"] if e["name"] == "PIPELINE_STORE_URI")
    assert store == json.loads((K8S / "overlays" / "ack" / "mounts.json").read_text())[0]["uri"]
    assert store.startswith("oss://") and store_settings() >= {"OSS_REGION", "OSS_ACCESS_KEY_ID"}


# -- checkpoints ----------------------------------------------------------------------------------------------------
# Parameter counts from the models' Hugging Face cards; train rows from the datasets (the DAPO set after the
# preprocess step's de-duplication: 17,917 unique rows). Bytes per parameter by verl's save_contents: the FSDP model
# shards are fp32 (4), Adam's two fp32 moments (8), the HF model bf16 (2); "extra" (RNG, scheduler) is negligible.
PARAMS = {
    "Qwen/Qwen2.5-3B-Instruct": 3.09e9,
    "Qwen/Qwen2.5-32B-Instruct": 32.8e9,
    "Qwen/Qwen3-4B-Instruct-2507": 4.02e9,
    "Qwen/Qwen3.5-9B": 9.65e9,
    "Qwen/Qwen2.5-VL-7B-Instruct": 8.29e9,  # the vision tower included
    "Qwen/Qwen2.5-VL-3B-Instruct": 3.75e9,
}
TRAIN_ROWS = {"gsm8k": 7473, "dapo_math": 17917, "geometry3k": 2101}
BYTES = {"model": 4, "optimizer": 8, "hf_model": 2, "extra": 0}
VERL_DEFAULT_CONTENTS = ["model", "optimizer", "extra"]  # verl 0.9.1 trainer/config/actor/actor.yaml
WRITE_BUDGET = 4e12  # bytes one run may write to the bucket in checkpoints (hours of ossfs / gcsfuse time)
KEEP_BUDGET = 1e12  # bytes of checkpoints one run leaves in the bucket


def checkpoint_plan(exp) -> dict:
    v = exp.verl
    rows = sum(TRAIN_ROWS[d] for d in exp.spec["datasets"]["train"])
    steps = rows // int(v["data.train_batch_size"]) * int(v.get("trainer.total_epochs", 1))
    if v.get("trainer.total_training_steps"):
        steps = min(steps, int(v["trainer.total_training_steps"]))
    freq = int(v.get("trainer.save_freq", -1))
    saves = 0 if freq <= 0 else steps // freq + (1 if steps % freq else 0)  # verl also saves at the last step
    contents = v.get("actor_rollout_ref.actor.checkpoint.save_contents") or VERL_DEFAULT_CONTENTS
    size = PARAMS[exp.spec["model"]["source"]] * sum(BYTES[c] for c in contents)
    keep = v.get("trainer.max_actor_ckpt_to_keep")
    kept = min(saves, int(keep)) if keep else saves
    return {"steps": steps, "saves": saves, "size": size, "written": saves * size, "kept": kept * size}


def test_verl_has_the_checkpoint_keys_the_budget_reads():
    from importlib.resources import files

    cfg = yaml.safe_load((files("verl") / "trainer/config/ppo_trainer.yaml").read_text())
    assert "max_actor_ckpt_to_keep" in cfg["trainer"] and "save_freq" in cfg["trainer"]
    actor = yaml.safe_load((files("verl") / "trainer/config/actor/actor.yaml").read_text())
    assert actor["checkpoint"]["save_contents"] == VERL_DEFAULT_CONTENTS


@pytest.mark.parametrize("preset,mounts,bucket,dataset", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_checkpoints_stay_under_budget(preset, mounts, bucket, dataset):
    exp, _ = render(preset, mounts, bucket, dataset)
    plan = checkpoint_plan(exp)
    assert plan["written"] <= WRITE_BUDGET, f"{preset}: {plan['saves']} saves x {plan['size'] / 1e9:.0f} GB"
    assert plan["kept"] <= KEEP_BUDGET, f"{preset}: keeps {plan['kept'] / 1e9:.0f} GB; set max_actor_ckpt_to_keep"
