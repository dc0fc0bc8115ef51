"""Experiment presets: loading, merge order, override parsing, and Hydra quoting checked against verl's real
Hydra composition (verl.trainer.config/ppo_trainer, on CPU)."""

from __future__ import annotations

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.training import experiment

PRESETS = [
    "local_tiny",
    "local_tiny_tool_agent",
    "local_tiny_custom_rollout",
    "local_arithmetic",
    "local_tiny_vl",
    "local_tool_learning",
    "gsm8k_qwen2_5_3b",
    "gsm8k_tool_agent_qwen2_5_3b",
    "dapo_qwen3_4b",
    "dapo_retool_qwen3_4b",
    "gsm8k_qwen2_5_32b",
    "gspo",
    "geo3k_qwen2_5_vl_7b",
    "geo3k_qwen2_5_vl_3b",
]


def test_every_shipped_preset_is_checked_here():
    assert sorted(PRESETS) == sorted(experiment.preset_names())


TRICKY = [
    "it's",
    'say "hi"',
    "a;b $(id) `id`",
    "${oc.env:HOME}",
    "\\${x}",
    "\\\\${x}",
    "end\\",
    "q\\'",
    "new\nline",
    "",
    "1e-6",
    "true",
    "null",
]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_with_pipeline_sections(name):
    exp = experiment.load(name)
    assert exp.name == name
    for section in ("model", "datasets", "evaluation", "cluster"):
        assert isinstance(exp.spec[section], dict), section
    cluster = exp.spec["cluster"]
    assert exp.verl["trainer.nnodes"] == cluster["nnodes"]
    if cluster["gpus_per_node"]:
        assert exp.verl["trainer.n_gpus_per_node"] == cluster["gpus_per_node"]
        for key in (
            "head",
            "worker",
            "tolerations",
            "node_selector",
            "active_deadline_seconds",
            "ttl_seconds_after_finished",
            "kueue_queue",
        ):
            assert key in cluster, key


def test_seed_workflow_settings():
    g3 = experiment.load("gsm8k_qwen2_5_3b")
    assert (g3.spec["cluster"]["nnodes"], g3.spec["cluster"]["gpus_per_node"]) == (1, 8)
    assert g3.verl["actor_rollout_ref.rollout.n"] == 16 and g3.verl["actor_rollout_ref.rollout.name"] == "vllm"
    assert g3.verl["actor_rollout_ref.rollout.mode"] == "async"
    d = experiment.load("dapo_qwen3_4b")
    assert d.spec["cluster"]["gpus_per_node"] == 4 and d.spec["datasets"]["val"] == ["aime2024"]
    assert (d.verl["actor_rollout_ref.actor.clip_ratio_low"], d.verl["actor_rollout_ref.actor.clip_ratio_high"]) == (
        0.2,
        0.28,
    )
    assert d.verl["actor_rollout_ref.actor.use_kl_loss"] is False and d.verl["algorithm.use_kl_in_reward"] is False
    assert d.verl["data.max_response_length"] == 16384
    g32 = experiment.load("gsm8k_qwen2_5_32b")
    assert (g32.spec["cluster"]["nnodes"], g32.spec["cluster"]["gpus_per_node"]) == (2, 8)
    assert g32.verl["actor_rollout_ref.actor.strategy"] == "fsdp2"
    assert g32.verl["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 8
    gs = experiment.load("gspo")
    assert gs.verl["actor_rollout_ref.actor.optim.lr"] == 7e-6
    assert gs.verl["actor_rollout_ref.actor.optim.lr_scheduler_type"] == "cosine"
    assert (gs.verl["data.train_batch_size"], gs.verl["actor_rollout_ref.rollout.n"]) == (128, 8)
    assert gs.verl["actor_rollout_ref.actor.ppo_mini_batch_size"] == 16
    assert gs.verl["actor_rollout_ref.actor.kl_loss_coef"] == 0.001
    assert gs.verl["actor_rollout_ref.actor.policy_loss.loss_mode"] == "gspo"


def test_merge_order_preset_then_cluster_then_derived_then_user():
    exp = experiment.load(
        "gsm8k_qwen2_5_3b",
        overrides=["trainer.nnodes=4", "actor_rollout_ref.actor.optim.lr=2e-6"],
        derived={"trainer.nnodes": 3, "data.train_files": ["file:///x/train.parquet"]},
    )
    assert exp.verl["trainer.nnodes"] == 4  # user beats derived beats cluster section
    assert exp.verl["actor_rollout_ref.actor.optim.lr"] == 2e-6  # YAML 1.1 would read "2e-6" as a string
    keys = list(exp.verl)
    assert keys[-2:] == ["trainer.nnodes", "actor_rollout_ref.actor.optim.lr"]  # applied last
    assert experiment.load("gsm8k_qwen2_5_3b", derived={"trainer.nnodes": 3}).verl["trainer.nnodes"] == 3
    a, b = experiment.load("gspo"), experiment.load("gspo", overrides=["data.train_batch_size=64"])
    assert a.digest() != b.digest() and a.digest() == experiment.load("gspo").digest()


@pytest.mark.parametrize(
    "text,match",
    [
        ("no_equals_sign", "expected KEY=VALUE"),
        ("bad key=1", "is not a dotted config key"),
        ("a..b=1", "is not a dotted config key"),
    ],
)
def test_parse_override_rejects_bad_input(text, match):
    with pytest.raises(UserError, match=match):
        experiment.parse_override(text)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(UserError, match=r"no such preset.*gspo"):
        experiment.load("nope")


def test_dict_keys_in_values_are_restricted():
    with pytest.raises(UserError, match="mapping key"):
        experiment.hydra_value({"a b": 1})


def test_hydra_quoting_round_trips_through_verl_hydra():
    """Every tricky string composes back to exactly itself (no interpolation, no lost backslash or quote)."""
    verl = {f"+extra.k{i}": v for i, v in enumerate(TRICKY)}
    verl["trainer.experiment_name"] = "x'y\"z${oc.env:PATH}"
    verl["trainer.logger"] = ["console", "a'b"]
    cfg = experiment.compose(experiment.Experiment("t", {}, verl))
    for i, v in enumerate(TRICKY):
        assert cfg.extra[f"k{i}"] == v, (v, cfg.extra[f"k{i}"])
    assert cfg.trainer.experiment_name == "x'y\"z${oc.env:PATH}"
    assert list(cfg.trainer.logger) == ["console", "a'b"]


def test_compose_names_a_misspelt_key_and_suggests_the_right_one():
    exp = experiment.load("local_tiny", overrides=["actor_rollout_ref.actor.optim.lrr=1e-6"])
    with pytest.raises(UserError) as err:
        experiment.compose(exp)
    msg = str(err.value)
    assert "actor_rollout_ref.actor.optim.lrr" in msg and "did you mean actor_rollout_ref.actor.optim.lr?" in msg
    assert "\n" not in msg
    assert experiment.suggest_key("trainer.nnode") == "trainer.nnodes"
    assert experiment.suggest_key("zzz.qqq") is None
