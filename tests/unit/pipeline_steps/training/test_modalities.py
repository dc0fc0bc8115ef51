"""What a model reads comes from the model (pipeline_steps/training/experiment.py ``model_modalities``): a local
build, its config.json in the Hugging Face cache, the preset's declaration, a table of known architectures checked
here against transformers' own config classes; plan refuses image rows only for a model that reads text alone."""

from __future__ import annotations

import json

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.planning import plan
from pipeline_steps.training import experiment


def test_known_architectures_agree_with_transformers_config_classes():
    """A model_type reads images exactly when its transformers config class has a vision_config sub-config."""
    from transformers import CONFIG_MAPPING

    for model_type in set(experiment.KNOWN_ARCHITECTURES.values()):
        has_vision = "vision_config" in (getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {})
        assert has_vision == (model_type in experiment.IMAGE_MODEL_TYPES), model_type
    assert "vision_config" in CONFIG_MAPPING["qwen3_5"].sub_configs  # Qwen3.5 is natively multimodal


def test_gspo_qwen3_5_reads_images_from_its_architecture_not_a_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # nothing cached: the table of known architectures
    spec = experiment.read("gspo").spec
    assert "modalities" not in spec["model"]  # not declared: before, that meant text only
    reads, how = experiment.model_modalities(spec)
    assert reads == {"text", "image"} and how == "known architecture qwen3_5"
    text, how = experiment.model_modalities(experiment.read("gsm8k_qwen2_5_3b").spec)
    assert text == {"text"} and how == "known architecture qwen2"
    assert experiment.model_modalities({"model": {"source": "someone/unknown-model"}})[0] == {"text"}
    assert experiment.model_modalities(experiment.read("local_tiny_vl").spec)[0] == {"text", "image"}
    assert experiment.model_modalities(experiment.read("local_tiny").spec)[0] == {"text"}


def _cache_config(cache, repo: str, config: dict) -> None:
    commit = "c" * 40
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "snapshots" / commit).mkdir(parents=True)
    (repo_dir / "snapshots" / commit / "config.json").write_text(json.dumps(config))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)


def test_a_cached_config_json_decides_over_the_name(monkeypatch, tmp_path):
    """A model's own config.json wins over the preset's declaration and the table of names."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _cache_config(tmp_path, "Qwen/Qwen2.5-3B-Instruct", {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}})
    _cache_config(tmp_path, "Qwen/Qwen3.5-9B", {"model_type": "qwen3"})
    reads, how = experiment.model_modalities({"model": {"source": "Qwen/Qwen2.5-3B-Instruct"}})
    assert reads == {"text", "image"} and "config.json" in how
    reads, how = experiment.model_modalities({"model": {"source": "Qwen/Qwen3.5-9B", "modalities": ["text", "image"]}})
    assert reads == {"text"} and "config.json" in how


def test_plan_takes_geometry3k_for_gspo_and_refuses_it_for_a_text_only_model_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("PIPELINE_MOUNTS", '[{"uri": "oss://verl-store", "claim": "verl-store", "path": "/mnt/store"}]')
    base = {"store_uri": "oss://verl-store/verl", "datasets": ["geometry3k"], "eval_dataset": "geometry3k"}
    run = plan.plan({"experiment": "gspo", **base}, None, "r", "d")
    assert {d["dataset"]: d["role"] for d in run["datasets"]}["geometry3k"] == "train"
    with pytest.raises(UserError) as err:
        plan.plan({"experiment": "gsm8k_qwen2_5_3b", **base}, None, "r", "d")
    msg = str(err.value)
    assert "\n" not in msg and "text-only model (known architecture qwen2)" in msg and "gspo" in msg
    # the form's model decides, not the preset's: a VL model typed in the form reads the images
    run = plan.plan({"experiment": "gsm8k_qwen2_5_3b", "model": "Qwen/Qwen2.5-VL-3B-Instruct", **base}, None, "r", "d")
    assert run["model"]["carry"]["model"] == "Qwen/Qwen2.5-VL-3B-Instruct"
    with pytest.raises(UserError, match=r"text-only model \(known architecture qwen2\)"):
        plan.plan({"experiment": "geo3k_qwen2_5_vl_3b", "model": "Qwen/Qwen2.5-3B-Instruct", **base}, None, "r", "d")


def test_local_tiny_vl_is_planned_with_its_pixel_limits_for_training_and_evaluation(offline_hub, monkeypatch, tmp_path):
    """A DAG run of local_tiny_vl (issue 47: the evaluate step's CPU generator reads the figures): plan takes it, and
    the preset's pixel limits reach both the trainer's overrides and the evaluate step's argv."""
    from pipeline_steps.training import experiment

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    run = plan.plan({"experiment": "local_tiny_vl"}, None, "r", "d")
    argv = run["steps"]["evaluate"]
    pixels = json.loads(argv[argv.index("--mm-processor-kwargs") + 1])
    assert pixels == {"min_pixels": 3136, "max_pixels": 12544} and argv[argv.index("--name") + 1] == "geometry3k"
    preset = experiment.read("local_tiny_vl")
    assert preset.spec["model"]["source"] == "tiny-vl"
    assert experiment.mm_processor_kwargs(preset.verl) == {"min_pixels": 3136, "max_pixels": 12544}
