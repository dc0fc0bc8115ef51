"""stage-model: a local directory and the project's tiny model into a store, skipped on the second run.

The Hugging Face Hub is unreachable here; the Hub path is checked only for its error (one line, exit 2) with the
offline fixture cache, which holds datasets, not models.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.storage_servers import run_step


def _summary(r):
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _quick_warmup(monkeypatch) -> None:
    """Builds in this module warm up for 2 steps, not 400: what they test is the staging and the cache, not the
    warm-up (by keyword: an edit of ``build``'s positional defaults once made this a full 400-step build)."""
    import functools

    from pipeline_steps.local import tiny_model

    monkeypatch.setattr(tiny_model, "build", functools.partial(tiny_model.build, format_warmup_steps=2))


@pytest.fixture
def env(tmp_path):
    return {"PIPELINE_CACHE_DIR": str(tmp_path / "cache")}


def test_stage_local_dir_to_file_store(tmp_path, env):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(b"\0" * 5000)
    root = f"file://{tmp_path}/store"
    first = _summary(run_step(["stage-model", "--model", str(model), "--dest", root], env))
    rev = first["revision"]
    assert len(rev) == 12 and first["skipped"] is False and first["uploaded"] == 2
    assert first["uri"] == f"{root}/models/local/my-model/{rev}"
    assert (tmp_path / "store" / "models/local/my-model" / rev / "model.safetensors").read_bytes() == b"\0" * 5000
    second = _summary(run_step(["stage-model", "--model", str(model), "--dest", root], env))
    assert (second["skipped"], second["uri"], second["bytes_uploaded"]) == (True, first["uri"], 0)
    # changed weights -> a different content revision, staged beside the first
    (model / "model.safetensors").write_bytes(b"\1" * 5000)
    third = _summary(run_step(["stage-model", "--model", str(model), "--dest", root], env))
    assert third["revision"] != rev and third["skipped"] is False
    # a damaged staged copy is not "already staged": it is re-staged
    (tmp_path / "store" / "models/local/my-model" / rev / "config.json").write_text('{"a": 2}')
    (model / "model.safetensors").write_bytes(b"\0" * 5000)
    fourth = _summary(run_step(["stage-model", "--model", str(model), "--dest", root], env))
    assert (fourth["revision"], fourth["skipped"], fourth["uploaded"]) == (rev, False, 1)


# slow: outside make test (whose session builds the tiny model first) the first stage-model builds it, 28 s of CPU of
# make test-fast's 3 minutes
@pytest.mark.slow
def test_stage_tiny_to_oss_then_skip(oss_server, tmp_path, tiny_model):
    # the run's own PIPELINE_CACHE_DIR (conftest), where make test built the tiny model once: this test is about the
    # staging and the skip (184 s in make test when it built its own copy; the build has its tests below)
    env = oss_server.env()
    first = _summary(
        run_step(["stage-model", "--model", "tiny", "--dest", "oss://test-bucket/stage"], env, timeout=300)
    )
    assert (
        first["uri"] == f"oss://test-bucket/stage/models/local/tiny/{first['revision']}" and first["skipped"] is False
    )
    # every file of the built tiny model (config, weights, tokenizer files), as the tiny_model fixture builds it
    assert first["files"] == sum(1 for p in tiny_model.rglob("*") if p.is_file()), first
    second = _summary(
        run_step(["stage-model", "--model", "tiny", "--dest", "oss://test-bucket/stage"], env, timeout=300)
    )
    assert (second["skipped"], second["revision"], second["bytes_uploaded"]) == (True, first["revision"], 0)


def test_stage_hub_model_unreachable_is_one_line(tmp_path, env):
    env = {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")}
    r = run_step(
        [
            "stage-model",
            "--model",
            "Qwen/Qwen2.5-0.5B-Instruct",
            "--revision",
            "main",
            "--dest",
            f"file://{tmp_path}/s",
        ],
        env,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Qwen/Qwen2.5-0.5B-Instruct" in r.stderr
    r = run_step(["stage-model", "--model", "not a repo", "--dest", f"file://{tmp_path}/s"], env)
    assert r.returncode == 2 and "org/name" in r.stderr


def test_tiny_at_a_staged_revision_is_not_rebuilt(tmp_path, monkeypatch, capsys):
    """The presets stage tiny at a named revision; once staged, a run reuses it instead of rebuilding (and re-training
    the format warm-up, whose float sums need not repeat bit for bit on another machine)."""
    from pipeline_steps import cli
    from pipeline_steps.local import tiny_model

    root = f"file://{tmp_path / 'store'}"
    argv = ["stage-model", "--model", "tiny", "--revision", "r1", "--dest", root]
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))  # its quick warm-up: not the run's cache
    _quick_warmup(monkeypatch)
    assert cli.main(argv) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["skipped"] is False and first["uri"].endswith("/models/local/tiny/r1")

    def no_build(*a, **kw):
        raise AssertionError("tiny model rebuilt although its revision is staged")

    monkeypatch.setattr(tiny_model, "build", no_build)
    assert cli.main(argv) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["skipped"] is True and second["uri"] == first["uri"] and second["files"] == first["files"]


def test_the_tiny_model_is_built_once_per_cache_and_without_one_when_it_cannot_be_written(
    tmp_path, monkeypatch, capsys, caplog
):
    """Every local run stages the same tiny model; its build (tokenizer, warm-up) runs once per PIPELINE_CACHE_DIR.
    A second store gets the cached bytes (same content revision, no build); a cache that cannot be written costs
    only the time of a build."""
    import logging

    from pipeline_steps import cli
    from pipeline_steps.local import tiny_model

    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    _quick_warmup(monkeypatch)
    builds = []
    real_build = tiny_model.build
    monkeypatch.setattr(tiny_model, "build", lambda *a, **kw: builds.append(a) or real_build(*a, **kw))

    def stage(store: str) -> dict:
        assert cli.main(["stage-model", "--model", "tiny", "--dest", f"file://{tmp_path / store}"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    first = stage("a")
    assert len(builds) == 1 and first["skipped"] is False
    # one complete entry, no temporary left (beside it the entry's build lock, .<digest>.lock)
    (entry,) = [p for p in (tmp_path / "cache" / "tiny-model").iterdir() if not p.name.endswith(".lock")]
    second = stage("b")
    assert len(builds) == 1, "rebuilt although the cache holds the model"
    assert (second["revision"], second["files"], second["skipped"]) == (first["revision"], first["files"], False)

    (tmp_path / "blocked").write_text("a file where the cache directory would be")
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "blocked"))
    with caplog.at_level(logging.WARNING):
        third = stage("c")
    assert len(builds) == 2 and third["skipped"] is False
    assert "build cache" in caplog.text and "not writable" in caplog.text
