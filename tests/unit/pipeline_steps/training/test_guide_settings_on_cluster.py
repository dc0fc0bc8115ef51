"""Guide settings that reach the cluster as the guides wrote them (issue 24, faults 6 and 7).

- A preset that names its own sandbox service (guide 003's Tencent AGS, ``cluster.sandbox_service``) gets it when the
  deployment sets ``PIPELINE_E2B_DOMAIN`` for another (guide 000's sandbox-manager): both run from one Airflow.
- Guide 003's ``LD_LIBRARY_PATH=/usr/local/cuda/compat:$LD_LIBRARY_PATH`` goes into Ray's runtime env and is expanded
  by Ray's own function (``ray._private.utils.update_envs``) from the image's value.
- Guide 004's worker ``rayStartParams.num-cpus: "220"`` is rendered, and KubeRay's validation (the stand-in's copy of
  validation.go) accepts it; it refuses it only beside a group-level ``resources`` field.
"""

from __future__ import annotations

import copy

import yaml

from tests.helpers.k8s_api_stand_in import kuberay_validation_error
from tests.helpers.render import ACK, GKE, render

AGS = "ap-shanghai.tencentags.com"  # guide 003's AGS region domain


def _env_vars(job) -> dict:
    return yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]


def _container_env(job) -> dict:
    pod = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


def test_each_preset_keeps_its_sandbox_service_beside_the_deployment_default(monkeypatch):
    from pipeline_steps.training import cluster_section, sandbox_services

    monkeypatch.setenv(cluster_section.IMAGE_ENV, "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)
    monkeypatch.setenv(sandbox_services.SANDBOX_DOMAIN_ENV, "sandbox.example.com")  # the deployment's sandbox-manager
    # (and, from the shipped Helm values, $PIPELINE_SANDBOX_SERVICES mapping the AGS preset's ags-shanghai)
    _, ags = render("dapo_retool_qwen3_4b", ACK, "oss://verl-store", "dapo_math")
    assert _env_vars(ags)["E2B_DOMAIN"] == AGS and _container_env(ags)["E2B_DOMAIN"] == AGS
    _, ack = render("gsm8k_tool_agent_qwen2_5_3b", ACK, "oss://verl-store", "gsm8k")
    assert _env_vars(ack)["E2B_DOMAIN"] == "sandbox.example.com"


def test_ld_library_path_extends_the_images_through_rays_runtime_env(monkeypatch):
    from ray._private.utils import update_envs

    from pipeline_steps.training import cluster_section

    monkeypatch.setenv(cluster_section.IMAGE_ENV, "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)
    for preset in ("dapo_qwen3_4b", "dapo_retool_qwen3_4b"):
        _, job = render(preset, ACK, "oss://verl-store", "dapo_math")
        value = _env_vars(job)["LD_LIBRARY_PATH"]
        assert "LD_LIBRARY_PATH" not in _container_env(job)  # Kubernetes would keep "${...}" literally
        monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64")  # the image's own
        update_envs({"LD_LIBRARY_PATH": value})  # what Ray does for the job's driver and workers
        import os

        assert os.environ["LD_LIBRARY_PATH"] == "/usr/local/cuda/compat:/usr/local/nvidia/lib64", preset


def test_the_32b_workers_ray_start_num_cpus_passes_kuberay_validation(monkeypatch):
    from pipeline_steps.training import cluster_section

    monkeypatch.setenv(cluster_section.IMAGE_ENV, "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)
    _, job = render("gsm8k_qwen2_5_32b", GKE, "gs://verl-store", "gsm8k")
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert group["rayStartParams"]["num-cpus"] == "220"
    assert kuberay_validation_error(job) is None
    refused = copy.deepcopy(job)
    refused["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["resources"] = {"CPU": "220"}
    assert "should not be set in both rayStartParams and Resources" in kuberay_validation_error(refused)
