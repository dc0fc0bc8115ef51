"""The CPU trainer follows verl 0.9.1's v1 trainer around the update: validation metric names, sampling, loop and
checkpoint rules (verl/trainer/ppo/v1/trainer_base.py ``fit``, ``_val_metrics_update``, ``_save_checkpoint``).

Real parts: the tiny model, verl's config, reward and metric functions, verl's checkpoint manager. The cluster side
cannot run here (no GPU), so the expected names come from verl's own functions called on the samples' scores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.train_local_runs import compose, write_gsm8k_parquet


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("parity")
    return {"model": tiny_model, "train": write_gsm8k_parquet(d / "train.parquet"), "dir": d}


def _cfg(assets, out: Path, overrides: list[str], val=True):
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    derived = train_local.derived_keys([assets["train"]], [assets["train"]] if val else [], assets["model"], out)
    return experiment.compose(experiment.load("local_tiny", overrides, derived=derived))


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _half(data_source, solution_str, ground_truth, extra_info=None):  # a float score: verl adds it as ``acc``
    return float(len(solution_str) % 2)


def test_validation_uses_verls_names_before_training_and_at_test_freq(assets, tmp_path):
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    from pipeline_steps.local import grpo_cpu

    out = tmp_path / "run"
    cfg = _cfg(assets, out, ["trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.val_before_train=true"])
    grpo_cpu.train(cfg, reward_fn=_half, metrics_path=out / "metrics.jsonl")
    lines = _lines(out / "metrics.jsonl")
    assert [x["step"] for x in lines] == [0, 1, 2]  # before training (step 0), then each step
    val0 = lines[0]["data"]
    n = int(cfg.actor_rollout_ref.rollout.val_kwargs.n)
    # the keys verl's metric function produces for these data sources and variables, placed as verl places them
    expected_vars = process_validation_metrics(["openai/gsm8k"] * 2, ["a", "b"], {"reward": [0.0, 1.0], "acc": [0, 1]})
    headline = f"val-core/openai/gsm8k/acc/mean@{n}"
    assert headline in val0 and 0.0 <= val0[headline] <= 1.0
    assert f"val-aux/openai/gsm8k/reward/mean@{n}" in val0
    assert {k.rsplit("/", 1)[1] for k in val0 if "/gsm8k/acc/" in k} == set(expected_vars["openai/gsm8k"]["acc"])
    assert not any(k.startswith("val-") for k in lines[1]["data"])  # test_freq=2: no validation at step 1
    assert headline in lines[2]["data"] and "timing_s/testing" in lines[2]["data"]


def test_val_before_train_runs_even_when_test_freq_is_off(assets, tmp_path):
    from pipeline_steps.local import grpo_cpu

    out = tmp_path / "run"
    cfg = _cfg(assets, out, ["trainer.total_training_steps=1", "trainer.test_freq=-1"])
    grpo_cpu.train(cfg, reward_fn=_half, metrics_path=out / "metrics.jsonl")
    lines = _lines(out / "metrics.jsonl")
    assert lines[0]["step"] == 0 and any(k.startswith("val-core/") for k in lines[0]["data"])
    cfg = _cfg(assets, tmp_path / "off", ["trainer.total_training_steps=1", "trainer.val_before_train=false"])
    grpo_cpu.train(cfg, reward_fn=_half, metrics_path=tmp_path / "off" / "metrics.jsonl")
    assert [x["step"] for x in _lines(tmp_path / "off" / "metrics.jsonl")] == [1]


def test_save_only_when_save_freq_positive_and_total_epochs_bounds_the_run(assets, tmp_path):
    from pipeline_steps.local import grpo_cpu

    out = tmp_path / "nosave"
    cfg = _cfg(assets, out, ["trainer.total_training_steps=1", "trainer.save_freq=-1"], val=False)
    summary = grpo_cpu.train(cfg, reward_fn=_half, metrics_path=out / "metrics.jsonl")
    assert summary["checkpoint_dir"] is None and not list((out / "checkpoints").glob("global_step_*"))

    out = tmp_path / "epochs"  # 8 rows / batch 4 = 2 steps per epoch; 1 epoch stops at step 2 of 5
    cfg = _cfg(
        assets,
        out,
        [
            "trainer.total_training_steps=5",
            "trainer.total_epochs=1",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ],
        val=False,
    )
    summary = grpo_cpu.train(cfg, reward_fn=_half, metrics_path=out / "metrics.jsonl")
    logged = [x["step"] for x in _lines(out / "metrics.jsonl")]
    assert logged == [1, 2] and summary["last_step"] == 2  # 8 rows / batch 4, one epoch: step 2 of 5


def test_checkpoint_has_data_pt_and_retention_removes_only_actor(assets, tmp_path):
    from pipeline_steps.local import grpo_cpu

    out = tmp_path / "keep"
    cfg = _cfg(
        assets,
        out,
        ["trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=1"],
        val=False,
    )
    grpo_cpu.train(cfg, reward_fn=_half, metrics_path=out / "metrics.jsonl")
    ck = out / "checkpoints"
    assert (ck / "global_step_3" / "actor").is_dir() and (ck / "global_step_3" / "data.pt").is_file()
    for old in (1, 2):  # verl's checkpoint manager deletes the old actor folder, not the step directory
        assert (ck / f"global_step_{old}").is_dir() and not (ck / f"global_step_{old}" / "actor").exists()
        assert (ck / f"global_step_{old}" / "data.pt").is_file()
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_sampling_ignores_the_models_repetition_penalty(assets, tmp_path):
    """verl's agent loop forces repetition_penalty=1.0; a model's generation_config must not change the samples."""
    import shutil

    from pipeline_steps.local import grpo_cpu

    penalised = tmp_path / "model"
    shutil.copytree(assets["model"], penalised)
    gc = penalised / "generation_config.json"
    conf = json.loads(gc.read_text()) if gc.is_file() else {}
    gc.write_text(json.dumps({**conf, "repetition_penalty": 5.0, "no_repeat_ngram_size": 2}))
    samples = []
    for model in (assets["model"], penalised):
        cfg = compose({**assets, "model": model}, tmp_path / f"r{len(samples)}", ["trainer.total_training_steps=1"])
        with grpo_cpu.process_group():
            trainer = grpo_cpu.GRPOTrainer(cfg, reward_fn=_half)
            batch = trainer.generate(trainer.train_prompts[:2], 2, temperature=1.0, top_p=1.0, top_k=-1, seed=7)
        samples.append(batch["responses"].tolist())
    assert samples[0] == samples[1]


def test_kl_in_reward_uses_verls_adaptive_controller_and_logs_its_metrics(assets, tmp_path):
    from pipeline_steps.local import grpo_cpu

    out = tmp_path / "kl"
    cfg = _cfg(
        assets,
        out,
        [
            "trainer.total_training_steps=3",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.1",
            "algorithm.kl_ctrl.target_kl=0.000001",
            "algorithm.kl_ctrl.horizon=10",
            "actor_rollout_ref.actor.optim.lr=0.01",
        ],
        val=False,
    )
    grpo_cpu.train(cfg, reward_fn=_half, metrics_path=out / "metrics.jsonl")
    lines = [x["data"] for x in _lines(out / "metrics.jsonl")]
    coeffs = [d["actor/reward_kl_penalty_coeff"] for d in lines]
    kls = [d["actor/reward_kl_penalty"] for d in lines]
    assert coeffs[0] == pytest.approx(0.1)
    # verl's AdaptiveKLController: below target at step 1 (policy == reference, KL 0) the coefficient shrinks; once
    # the policy has moved (KL > target) it grows again. A fixed coefficient would stay at 0.1.
    assert kls[0] == pytest.approx(0.0, abs=1e-9) and kls[-1] > 1e-6
    assert coeffs[1] < coeffs[0] and coeffs[2] > coeffs[1]


def test_lr_logged_is_the_next_steps_as_verl_logs_it_and_losses_are_reported(assets, tmp_path):
    from pipeline_steps.local import grpo_cpu

    out = tmp_path / "lr"
    cfg = _cfg(
        assets,
        out,
        [
            "trainer.total_training_steps=2",
            "actor_rollout_ref.actor.optim.lr=0.001",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=4",
            "actor_rollout_ref.actor.entropy_coeff=0.001",
        ],
        val=False,
    )
    grpo_cpu.train(cfg, reward_fn=_half, metrics_path=out / "metrics.jsonl")
    lines = [x["data"] for x in _lines(out / "metrics.jsonl")]
    # linear warm-up over 4 steps: step 1 trains at 0 and logs the rate after the scheduler's step, 0.25e-3
    # (verl's engine logs lr_scheduler_step()'s return value); step 2 logs 0.5e-3
    assert lines[0]["actor/lr"] == pytest.approx(0.00025)
    assert lines[1]["actor/lr"] == pytest.approx(0.0005)
    for key in ("actor/loss", "actor/entropy_loss", "actor/pg_loss", "global_seqlen/mean", "global_seqlen/minmax_diff"):
        assert key in lines[0]
    assert 0 < lines[0]["perf/mfu/actor"] < 1  # verl's FlopsCounter against its CPU peak


def test_reward_manager_the_cpu_backend_cannot_honour_is_refused_in_one_line(assets, tmp_path):
    from pipeline_steps.errors import UserError
    from pipeline_steps.local import grpo_cpu

    cfg = _cfg(assets, tmp_path / "rm", ["reward.reward_manager.name=dapo"], val=False)
    with pytest.raises(UserError, match="reward.reward_manager.name='dapo'") as err:
        grpo_cpu.train(cfg, reward_fn=_half, metrics_path=tmp_path / "rm" / "metrics.jsonl")
    assert "\n" not in str(err.value)


def test_reward_gets_verls_extra_info_and_may_be_async_and_num_turns_is_logged(assets, tmp_path):
    from pipeline_steps.local import grpo_cpu

    seen = []

    async def scorer(data_source, solution_str, ground_truth, extra_info=None):  # verl awaits async scorers
        seen.append(extra_info)
        return {"score": 1.0, "acc": True}

    out = tmp_path / "async"
    cfg = _cfg(assets, out, ["trainer.total_training_steps=1"], val=False)
    grpo_cpu.train(cfg, reward_fn=scorer, metrics_path=out / "metrics.jsonl")
    assert seen and all(e["num_turns"] == 2 and e["rollout_reward_scores"] == {} for e in seen)
    assert all(e["turn_scores"] == [] and e["tool_rewards"] == [] for e in seen)  # verl's single-turn loop's fields
    assert all("index" in e for e in seen)  # the row's own extra_info is kept
    data = _lines(out / "metrics.jsonl")[0]["data"]
    assert data["critic/score/mean"] == 1.0
    assert data["training/num_turns/mean"] == 2 and data["num_turns/max"] == 2
