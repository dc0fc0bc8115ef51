"""The renderer refuses, in one line, a preset whose node-specific settings belong to another cloud than the
overlay whose mounts it renders with: the GKE-only 32B preset (gIB host paths, RDMA annotations, a GKE accelerator
label) with ACK's bucket mounts would never schedule or start."""

from __future__ import annotations

import pytest

from pipeline_steps.errors import UserError
from tests.helpers.render import ACK, EXAMPLES, GKE, render

IMAGE = "registry.example.com/verl-grpo-train@sha256:" + "0" * 64


@pytest.fixture(autouse=True)
def image(monkeypatch):
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", IMAGE)


def test_the_gke_preset_with_ack_mounts_is_refused_in_one_line():
    with pytest.raises(UserError) as err:
        render("gsm8k_qwen2_5_32b", ACK, "oss://verl-store", "gsm8k")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("cluster.worker_annotations networking.gke.io/")
    assert "is for GKE nodes, but the mounts (oss://verl-store) are ACK's" in message
    assert "k8s/overlays/gke/mounts.json" in message


def test_every_preset_renders_with_its_own_clouds_mounts():
    for preset, mounts, bucket, dataset in EXAMPLES:
        render(preset, mounts, bucket, dataset)


@pytest.mark.parametrize(
    "cluster, refused",
    [
        ({"worker_host_paths": {"/usr/local/gib": "/home/kubernetes/bin/gib"}}, "cluster.worker_host_paths"),
        ({"node_selector": {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"}}, "cluster.node_selector"),
        ({"worker_annotations": {"k8s.aliyun.com/eni-interfaces": "[]"}}, None),  # ACK's own, on ACK
    ],
)
def test_each_node_setting_is_checked(tmp_path, cluster, refused):
    import yaml

    from pipeline_steps.training import experiment

    spec = yaml.safe_load(experiment.resolve_path("gsm8k_qwen2_5_3b").read_text())
    spec["cluster"].update(cluster)
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump(spec))
    if refused:
        with pytest.raises(UserError, match=f"^{refused} .* is for GKE nodes"):
            render(str(preset), ACK, "oss://verl-store", "gsm8k")
        render(str(preset), GKE, "gs://verl-store", "gsm8k")
    else:
        render(str(preset), ACK, "oss://verl-store", "gsm8k")
        with pytest.raises(UserError, match="is for ACK nodes, but the mounts"):
            render(str(preset), GKE, "gs://verl-store", "gsm8k")
