"""Shared fixtures: an offline Hugging Face cache built from the shipped fixtures, and the tiny local model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hub"
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache (HF_HUB_CACHE) holding every fixture repository; the Hub itself is unreachable here."""
    from pipeline_steps import local_hub

    cache = tmp_path_factory.mktemp("hf-cache")
    index = local_hub.build_cache(FIXTURES, cache)
    return {"path": cache, "index": index}


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache["path"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from pipeline_steps import tiny_model

    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model")


def run_step(*args, env=None, check=None, cwd=ROOT):
    """Run ``python -m pipeline_steps ...`` as a user would; returns (exit code, summary dict, stderr)."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    p = subprocess.run([sys.executable, "-m", "pipeline_steps", *map(str, args)], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=600)
    lines = p.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else None
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}, stderr:\n{p.stderr[-3000:]}"
    return p.returncode, summary, p.stderr
