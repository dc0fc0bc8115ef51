"""Fixtures for models and the Hugging Face Hub: an offline Hugging Face cache built from the shipped fixtures
(``hub_cache``, and ``offline_hub`` pointing the process at it) and the tiny local model (``tiny_model``).
Registered for every test module by ``pytest_plugins`` in tests/conftest.py."""

from __future__ import annotations

import pytest


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
    # responses vary in form, which their rewards rely on); tests/e2e/test_learning.py builds the warmed-up default
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model", format_warmup_steps=0)


@pytest.fixture(scope="session")
def tiny_vl_model(tmp_path_factory):
    """The tiny vision-language model (random Qwen2.5-VL with its processor), as stage-model builds ``tiny-vl`` but
    without its warm-up: the random model the image-path tests were written against (the e2e test of
    local_tiny_vl, tests/e2e/test_vision_language_dag.py, stages the warmed-up one)."""
    from pipeline_steps.local import tiny_vl_model

    return tiny_vl_model.build(tmp_path_factory.mktemp("tiny-vl") / "model", warmup_steps=0)
