"""Issue 46 item 6: every preset the trigger form offers (the DAG's enum, ``experiment.preset_names(offered=True)``)
passes ``plan`` and pre-flight on its own backend, as the DAG's plan and train tasks run them; a preset meant only
for ``make demo-tools`` (``form: false``) is not offered, and the plan task refuses it in one line.

Before: ``local_tool_learning`` was in the form's list and failed pre-flight ("trainer.save_freq=-1: ... nothing to
evaluate or export") after its datasets and model had been downloaded and staged.
"""

from __future__ import annotations

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.planning import plan
from pipeline_steps.training import experiment

MOUNTS = '[{"uri": "oss://verl-store", "claim": "verl-store", "path": "/mnt/store"}]'
OFFERED = experiment.preset_names(offered=True)


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    """A deployment as the DAG sees it: a home for the local store, and the kuberay pods' bucket mount."""
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.delenv("PIPELINE_STORE_URI", raising=False)
    monkeypatch.delenv("PIPELINE_PRESETS_DIR", raising=False)
    monkeypatch.setenv("PIPELINE_MOUNTS", MOUNTS)
    return tmp_path


def planned(name: str) -> dict:
    """The plan task's plan for a form naming only ``name`` (its own backend; a cluster preset's store on the
    pods' bucket mount, as a cluster deployment sets it)."""
    preset = experiment.read(name)
    params = {"experiment": name}
    if preset.spec.get("backend") != "local":
        params.update(backend="kuberay", store_uri="oss://verl-store/verl")
    return plan.plan(params, None, "manual__2026-12-01T00:00:00+00:00", "verl_grpo_pipeline")


def trained(run: dict) -> experiment.Experiment:
    """The experiment the train task pre-flights (operators/train.py ``_load``): the plan's preset and overrides with
    the keys the pipeline derives (data files, staged model, checkpoint directory)."""
    store, run_dir = run["store"], run["run_dir"]
    model = run["model"]["carry"]["model"]
    derived = {
        "data.train_files": [f"{store}/datasets/{d['dataset']}/c/h/train.parquet" for d in run["datasets"]],
        "data.val_files": [f"{store}/datasets/{name}/c/h/test.parquet" for name in run["val_datasets"]],
        "actor_rollout_ref.model.path": f"{store}/models/{model}/main",
        "trainer.default_local_dir": f"{run_dir}/checkpoints",
    }
    exp = experiment.from_plan(run, derived)
    exp.spec["backend"] = "local" if run["backend"] == "local" else "cluster"
    return exp


def test_the_form_offers_every_preset_but_the_demo_only_one():
    assert "local_tool_learning" in experiment.preset_names()
    assert "local_tool_learning" not in OFFERED
    assert {"local_tiny", "local_arithmetic", "gsm8k_qwen2_5_3b", "geo3k_qwen2_5_vl_7b"} <= set(OFFERED)


@pytest.mark.parametrize("name", OFFERED)
def test_every_offered_preset_plans_on_its_backend(name, deployment):
    run = planned(name)
    assert run["experiment"] == name
    assert run["backend"] == ("local" if experiment.read(name).spec.get("backend") == "local" else "kuberay")
    assert not list(deployment.iterdir())  # planning writes nothing (the plan task saves plan.json afterwards)


@pytest.mark.slow  # verl's config composed once per preset (about 5 s each)
@pytest.mark.budget(400)
def test_every_offered_preset_passes_plan_and_preflight_on_its_backend(deployment):
    from pipeline_steps.training.preflight_checks import preflight

    failed = {}
    for name in OFFERED:
        try:
            summary = preflight(trained(planned(name)), check_store=False)
            assert summary["memory"]["estimate_gb"] <= summary["memory"]["budget_gb"], (name, summary["memory"])
        except UserError as exc:
            failed[name] = str(exc)
    assert not failed, failed


def test_a_preset_not_offered_is_refused_by_plan_in_one_line(deployment):
    with pytest.raises(UserError) as err:
        planned("local_tool_learning")
    message = str(err.value)
    assert "\n" not in message and "'local_tool_learning' is not offered for DAG runs (form: false" in message
    assert "make demo-tools" in message and "local_tiny" in message


def test_a_deployment_preset_can_stay_out_of_the_form(deployment, tmp_path, monkeypatch):
    presets = tmp_path / "presets"
    presets.mkdir()
    source = experiment.resolve_path("local_tiny").read_text()
    (presets / "team_probe.yaml").write_text(source.replace("name: local_tiny", "name: team_probe") + "form: false\n")
    (presets / "team_ok.yaml").write_text(source.replace("name: local_tiny", "name: team_ok"))
    monkeypatch.setenv("PIPELINE_PRESETS_DIR", str(presets))
    assert "team_ok" in experiment.preset_names(offered=True)
    assert "team_probe" not in experiment.preset_names(offered=True)
    assert "team_probe" in experiment.preset_names()  # still a preset: train-local and preflight run it
