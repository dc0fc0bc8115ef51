"""Pre-flight: verl 0.9.1's real Hydra config, validate_config and registries on CPU, plus our checks; the
store check runs against the real local store (file:// URIs, manifests written by its upload_dir)."""

from __future__ import annotations

import json

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.training import experiment
from pipeline_steps.training import preflight_checks as preflight
from tests.helpers.step_cli import run_step

CLUSTER_PRESETS = [
    "gsm8k_qwen2_5_3b",
    "gsm8k_tool_agent_qwen2_5_3b",
    "dapo_qwen3_4b",
    "dapo_retool_qwen3_4b",
    "gsm8k_qwen2_5_32b",
    "gspo",
    "geo3k_qwen2_5_vl_7b",
    "geo3k_qwen2_5_vl_3b",
]


def check(name="local_tiny", overrides=(), derived=None, check_store=False):
    return preflight.preflight(
        experiment.load(name, overrides=list(overrides), derived=derived), check_store=check_store
    )


def test_verl_s_prints_are_info_records_not_stderr(capfd, caplog):
    """In an Airflow task (the train operator runs the pre-flight in process) raw stderr is filed as ERROR: verl's
    "All configuration checks passed successfully!" must reach the log as an INFO record, not as stderr."""
    with caplog.at_level("INFO", logger=preflight.__name__):
        check("local_tiny")
    out, err = capfd.readouterr()
    assert "All configuration checks passed" not in out + err
    passed = [r for r in caplog.records if "All configuration checks passed successfully" in r.getMessage()]
    assert passed and all(r.levelname == "INFO" for r in passed), caplog.records


@pytest.mark.parametrize(
    "name",
    ["local_tiny", "local_tiny_tool_agent", "local_tiny_custom_rollout", "local_arithmetic", "local_tiny_vl"]
    + CLUSTER_PRESETS,
)
def test_every_preset_passes(name):
    out = check(name)
    exp = experiment.load(name)
    assert out["experiment"] == name and out["digest"] == exp.digest()
    assert out["n_gpus"] == exp.verl["trainer.nnodes"] * exp.verl["trainer.n_gpus_per_node"]
    assert out["train_batch_size"] == exp.verl["data.train_batch_size"]
    if exp.verl.get("actor_rollout_ref.rollout.multi_turn.tool_config_path"):  # the tool config was read, checked
        assert out["tools"] == ["code_interpreter"], out
    if exp.verl.get("actor_rollout_ref.rollout.agent.agent_loop_config_path"):  # so was a preset's own agent loop
        assert out["agent_loops"] == ["mcp_math_agent"], out


@pytest.mark.parametrize(
    "override,match",
    [
        ("trainer.nnodes=two", r"^trainer.nnodes='two': expected an integer"),
        (
            "actor_rollout_ref.actor.clip_ratio_high=wide",
            r"^actor_rollout_ref.actor.clip_ratio_high='wide': expected float",
        ),
        ("actor_rollout_ref.actor.use_kl_loss=1", r"^actor_rollout_ref.actor.use_kl_loss=1: expected bool"),
        ("actor_rollout_ref.rollout.n=2.5", r"^actor_rollout_ref.rollout.n=2.5: expected int"),
        (
            "algorithm.adv_estimator=grpoo",
            r"^algorithm.adv_estimator='grpoo' is not an advantage estimator verl knows; choose one of \[.*'grpo'",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspoo",
            r"^actor_rollout_ref.actor.policy_loss.loss_mode='gspoo' is not a policy loss",
        ),
        ("actor_rollout_ref.rollout.name=vlm", r"^actor_rollout_ref.rollout.name='vlm' is not a rollout engine"),
        (
            "actor_rollout_ref.actor.optim.lrr=1e-6",
            r"'actor_rollout_ref.actor.optim.lrr'.*did you mean actor_rollout_ref.actor.optim.lr\?",
        ),
        (
            "data.train_batch_size=3",
            r"^actor_rollout_ref.actor.ppo_mini_batch_size=2 must divide data.train_batch_size=3",
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            r"ppo_micro_batch_size_per_gpu=3 must divide the per-GPU mini-batch 8",
        ),
        (
            "actor_rollout_ref.actor.loss_agg_mode=token-meen",
            r"^verl's validate_config rejected the config: .*token-meen",
        ),
    ],
)
def test_bad_config_is_one_line_naming_the_key(override, match):
    with pytest.raises(UserError, match=match) as err:
        check(overrides=[override])
    assert "\n" not in str(err.value)


def test_batch_sizes_must_divide_over_nodes_and_gpus():
    # 16 prompts x 16 = 256 responses over 3 x 8 = 24 GPUs does not divide
    with pytest.raises(
        UserError, match=r"data.train_batch_size x actor_rollout_ref.rollout.n = 16 x 16 = 256 .* 3 x 8 = 24 GPUs"
    ):
        check("gsm8k_qwen2_5_3b", overrides=["trainer.nnodes=3"])
    with pytest.raises(UserError, match=r"tensor_model_parallel_size=8 does not divide .* = 12 GPUs"):
        check(
            "gsm8k_qwen2_5_32b",
            overrides=[
                "trainer.n_gpus_per_node=6",
                "data.train_batch_size=480",
                "actor_rollout_ref.actor.ppo_mini_batch_size=120",
            ],
        )
    with pytest.raises(UserError, match=r"ppo_mini_batch_size x rollout.n = 4 x 4 = 16 does not divide over 32"):
        check(
            "local_tiny",
            overrides=[
                "trainer.n_gpus_per_node=32",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "data.train_batch_size=8",
            ],
        )
    with pytest.raises(UserError, match=r"^trainer.nnodes=0: must be a positive integer"):
        check("local_tiny", overrides=["trainer.nnodes=0"])


def test_missing_required_key_is_named_but_unused_sections_are_ignored():
    with pytest.raises(UserError, match=r"^actor_rollout_ref.rollout.name is required but not set"):
        preflight.preflight(
            experiment.Experiment(
                "bare",
                {"backend": "local"},
                {k: v for k, v in experiment.load("local_tiny").verl.items() if k != "actor_rollout_ref.rollout.name"},
            ),
            check_store=False,
        )
    # reward.reward_model.rollout.name is also '???' in verl's defaults, but no reward model is enabled: fine
    assert check()["rollout"] == "hf"


def test_local_rollout_only_on_the_local_backend():
    with pytest.raises(UserError, match=r"rollout.name='hf' is not a rollout engine for the cluster backend"):
        check("gspo", overrides=["actor_rollout_ref.rollout.name=hf"])


@pytest.fixture
def staged(tmp_path):
    from pipeline_steps.store import open_store

    data, model = tmp_path / "src-data", tmp_path / "src-model"
    data.mkdir()
    model.mkdir()
    (data / "train.parquet").write_bytes(b"PAR1 not really parquet")
    (data / "test.parquet").write_bytes(b"PAR1 not really parquet either")
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    root = f"file://{tmp_path}/store"
    store = open_store(root)
    ds = f"{root}/datasets/gsm8k/rev1/abc123"
    mdl = f"{root}/models/tiny/local"
    store.upload_dir(data, ds)
    store.upload_dir(model, mdl)
    return {"ds": ds, "model": mdl, "root": root, "tmp": tmp_path}


def test_staged_inputs_pass(staged):
    out = check(
        derived={
            "data.train_files": [f"{staged['ds']}/train.parquet"],
            "data.val_files": [f"{staged['ds']}/test.parquet"],
            "actor_rollout_ref.model.path": staged["model"],
        },
        check_store=True,
    )
    assert out["staged"] == {
        "data.train_files": [staged["ds"]],
        "data.val_files": [staged["ds"]],
        "actor_rollout_ref.model.path": [staged["model"]],
    }


def test_unstaged_inputs_fail_naming_the_key(staged):
    from pipeline_steps.store import open_store

    ok = {
        "data.train_files": [f"{staged['ds']}/train.parquet"],
        "data.val_files": [f"{staged['ds']}/test.parquet"],
        "actor_rollout_ref.model.path": staged["model"],
    }
    with pytest.raises(UserError, match=r"^data.train_files='.*/nope.parquet': version .* has no file 'nope.parquet'"):
        check(derived={**ok, "data.train_files": [f"{staged['ds']}/nope.parquet"]}, check_store=True)
    # files present but no manifest: an interrupted upload is not staged
    half = f"{staged['root']}/datasets/gsm8k/rev2/def456"
    open_store(half).write_bytes(f"{half}/train.parquet", b"x")
    with pytest.raises(UserError, match=r"^data.train_files=.*rev2/def456/train.parquet' is not staged"):
        check(derived={**ok, "data.train_files": [f"{half}/train.parquet"]}, check_store=True)
    with pytest.raises(UserError, match=r"^actor_rollout_ref.model.path='.*' is not a store URI"):
        check("gspo", derived={**ok, "actor_rollout_ref.model.path": "/models/qwen"}, check_store=True)
    with pytest.raises(UserError, match=r"^actor_rollout_ref.model.path=.*has no config.json"):
        check(derived={**ok, "actor_rollout_ref.model.path": staged["ds"]}, check_store=True)
    with pytest.raises(UserError, match=r"^data.train_files='~/data/rlhf/gsm8k/train.parquet' is not a store URI"):
        check("gspo", derived={"actor_rollout_ref.model.path": staged["model"]}, check_store=True)
    with pytest.raises(UserError, match=r"^data.val_files='~/data/rlhf/gsm8k/test.parquet' is not a store URI"):
        check("gspo", derived={k: v for k, v in ok.items() if k != "data.val_files"}, check_store=True)


@pytest.mark.slow  # about 9 s of CPU: the CLI imports verl
def test_cli_exits_2_with_one_line_naming_the_key():
    code, summary, stderr = run_step(
        "preflight",
        "--experiment",
        "local_tiny",
        "--skip-store-check",
        "--override",
        "actor_rollout_ref.actor.optim.lrr=1e-6",
    )
    assert code == 2
    assert summary["ok"] is False and "actor_rollout_ref.actor.optim.lrr" in summary["error"]
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and "Traceback" not in stderr


@pytest.mark.slow  # about 8 s of CPU: the CLI imports verl
def test_cli_success_prints_the_summary_last():
    code, summary, stderr = run_step("preflight", "--experiment", "local_tiny", "--skip-store-check")
    assert code == 0, stderr
    assert summary["ok"] is True and summary["experiment"] == "local_tiny" and summary["n_gpus"] == 1
    assert summary["seconds"] > 0


@pytest.mark.parametrize("value", ["-1", "0"])
def test_a_run_that_would_save_no_checkpoint_fails_preflight_in_one_line(value):
    # in-process: the CLI's one-line exit 2 for any UserError is test_cli_exits_2_with_one_line_naming_the_key's
    with pytest.raises(UserError, match=r"trainer\.save_freq.*nothing to evaluate") as err:
        check("gsm8k_qwen2_5_3b", overrides=[f"trainer.save_freq={value}"])
    assert "\n" not in str(err.value)
