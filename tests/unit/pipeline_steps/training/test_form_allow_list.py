"""Issue 46: the trigger form (and the REST API's conf, read by the same plan task) may set only the verl keys of one
reviewed table (pipeline_steps/training/form_keys.py), each within its type and range; everything else comes from a
preset. Each probe of the issue goes through the real ``plan`` (what the DAG's plan task calls) and must be refused
in one line naming the key and where it may be set instead, before anything is read or written.

Before: every probe below passed plan and pre-flight (the form was checked against a deny-list), and
``+ray_kwargs.ray_init.runtime_env.py_executable`` landed in the RayJob entrypoint that every GPU pod runs.
"""

from __future__ import annotations

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.planning import form, plan
from pipeline_steps.training import form_keys
from tests.helpers.form_probes import OUT_OF_RANGE, PRESET_INSTEAD, PROBES


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.delenv("PIPELINE_STORE_URI", raising=False)
    return tmp_path


def refused(params: dict, home) -> str:
    with pytest.raises(UserError) as err:
        plan.plan({"experiment": "local_tiny", **params}, None, "manual__1", "verl_grpo_pipeline")
    message = str(err.value)
    assert "\n" not in message, message
    assert not list(home.iterdir()), "plan wrote something before refusing"  # no store, no plan.json, no download
    return message


@pytest.mark.parametrize("override,fields,needle", PROBES, ids=[p[0].split("=")[0][-40:] for p in PROBES])
def test_each_probe_of_the_issue_is_refused_by_plan_in_one_line(override, fields, needle, home):
    message = refused({**fields, "verl_overrides": [override]}, home)
    assert message.startswith("verl_overrides "), message
    assert needle in message and PRESET_INSTEAD in message, message


@pytest.mark.parametrize("override,needle", OUT_OF_RANGE, ids=[o[0].split("=")[0][-40:] for o in OUT_OF_RANGE])
def test_values_out_of_range_are_refused_by_plan(override, needle, home):
    message = refused({"verl_overrides": [override]}, home)
    assert needle in message and "expected" in message, message


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"total_training_steps": 10**12}, "form field 'total_training_steps'=1000000000000: expected an integer"),
        ({"learning_rate": 5}, "form field 'learning_rate'=5: expected a number > 0"),
        ({"rollout_n": 10**6}, "form field 'rollout_n'"),
        ({"train_batch_size": 0}, "form field 'train_batch_size'"),
        ({"kl_coef": float("nan")}, "not a finite number"),
        ({"nnodes": True}, "form field 'nnodes'"),
        ({"gpus_per_node": 1000}, "form field 'gpus_per_node'"),
    ],
)
def test_the_forms_numeric_fields_are_bounded_in_plan_too(fields, needle, home):
    """A REST API conf need not pass the form's JSON schema: plan checks the same ranges."""
    assert needle in refused(fields, home)


def test_a_10_mb_override_is_refused_in_one_line_and_not_carried_into_the_plan(home):
    huge = "trainer.experiment_name=" + "x" * (10 * 1024 * 1024)
    message = refused({"verl_overrides": [huge]}, home)
    assert len(message) < 400, message[:400]
    assert "form field 'verl_overrides' item 1: 10485784 characters" in message
    assert f"over the limit of {form.MAX_OVERRIDE} characters" in message


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"store_uri": "file:///" + "d/" * 600_000}, "form field 'store_uri': 1200008 characters"),
        ({"datasets": ["gsm8k"] * 100_000}, "form field 'datasets': 100000 items"),
        ({"dataset_revisions": {f"d{i}": "main" for i in range(1000)}}, "form field 'dataset_revisions': 1000 items"),
        ({"verl_overrides": ["trainer.save_freq=1"] * 1000}, "form field 'verl_overrides': 1000 items"),
        ({"verl_overrides": "trainer.save_freq=1"}, "expected a list of KEY=VALUE strings"),
        ({"model": "a" * 5000 + "/b"}, "form field 'model': 5002 characters"),
        ({"unknown_conf_key": {"a": {"b": {"c": {"d": 1}}}}}, "nested 4 levels deep"),
        ({f"k{i}": 1 for i in range(1000)}, "run conf: 1001 fields"),
    ],
    ids=["store_uri", "datasets", "revisions", "overrides", "not-a-list", "model", "nested", "fields"],
)
def test_every_string_and_array_from_the_form_has_a_size_limit(params, needle, home):
    assert needle in refused(params, home)


def test_trust_remote_code_belongs_to_the_presets_own_model(home, tmp_path, monkeypatch):
    """A preset may trust its own model's code; a model typed into the form never inherits that."""
    presets = tmp_path / "presets"
    presets.mkdir()
    source = (plan.experiment.resolve_path("local_tiny")).read_text()
    (presets / "team.yaml").write_text(
        source.replace("name: local_tiny", "name: team") + "  actor_rollout_ref.model.trust_remote_code: true\n"
    )
    monkeypatch.setenv("PIPELINE_PRESETS_DIR", str(presets))
    run = plan.preset_settings({"experiment": "team"})[1]  # its own model: planned
    assert run["preset"]["verl"]["actor_rollout_ref.model.trust_remote_code"] is True
    plan.preset_settings({"experiment": "team", "model": "tiny"})  # the preset's model typed again: the same
    with pytest.raises(UserError) as err:
        plan.preset_settings({"experiment": "team", "model": "attacker/model-with-code"})
    message = str(err.value)
    assert "\n" not in message and "model 'attacker/model-with-code' typed into the form" in message, message
    assert "actor_rollout_ref.model.trust_remote_code=True" in message and "choose the preset's model" in message


def test_what_a_user_tunes_still_plans(home):
    overrides = [
        "actor_rollout_ref.actor.optim.lr=2e-6",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.entropy_coeff=0.001",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "data.max_prompt_length=512",
        "data.max_response_length=64",
        "actor_rollout_ref.rollout.response_length=64",
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.top_p=0.95",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
        "trainer.save_freq=2",
        "trainer.test_freq=5",
        "trainer.total_training_steps=10",
        "trainer.total_epochs=3",
        "trainer.logger=[console,file]",
        "trainer.project_name=my-project",
        "trainer.experiment_name=run_2026.12-a",
        "+data.mm_processor_kwargs.max_pixels=200704",
    ]
    run = plan.plan({"experiment": "local_tiny", "verl_overrides": overrides}, None, "manual__1", "d")
    assert run["overrides"][-len(overrides) :] == overrides


def test_the_table_is_sound():
    """Every key of the table is one of verl's own (or a '+' leaf of a map verl leaves empty), none names a path,
    Ray or remote code, and every number has a range the form's schema carries."""
    from pipeline_steps.training import experiment

    defaults = experiment.verl_defaults()
    for key, rule in form_keys.KEYS.items():
        assert not form_keys.is_path_key(key) and "ray_kwargs" not in key and "trust_remote_code" not in key, key
        node = defaults
        for part in key.split(".")[:-1]:
            node = node[part]
        assert key.startswith("data.mm_processor_kwargs.") or key.split(".")[-1] in node, key
        if rule.kind in ("number", "integer"):
            assert rule.minimum is not None and rule.maximum is not None, key
            schema = rule.json_schema()
            assert schema["maximum"] == rule.maximum and ("minimum" in schema or "exclusiveMinimum" in schema), key
        if rule.kind in ("name", "list"):
            assert 0 < rule.max_length <= 128, key


def test_the_form_fields_take_their_ranges_from_the_table():
    for name, field in form.FIELDS.items():
        assert field.schema == form_keys.KEYS[field.verl_key].json_schema(), name
        assert field.schema["maximum"] is not None, name


def test_a_step_command_line_is_not_the_form():
    """``--override`` on a step's command line is typed by someone with a shell: the allow-list is the form's."""
    from pipeline_steps.training import experiment

    exp = experiment.load("local_tiny", ["actor_rollout_ref.rollout.gpu_memory_utilization=0.5"])
    assert exp.verl["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.5
