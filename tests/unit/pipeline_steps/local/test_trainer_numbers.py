"""The CPU trainer's numbers against verl 0.9.1's own functions, fed the same tensors (issue 27's parity rows).

The oracle is verl's code, not ours: ``ray_trainer.compute_advantage`` called as the v1 trainer calls it, and the v1
engine worker's loss ``verl.workers.utils.losses.ppo_loss`` fed the nested (unpadded) micro-batch the worker builds,
so its padding (to the longest response of each micro-batch) is verl's own. The trainer's side is its real
``advantages`` and ``update`` on the tiny model. The FSDP engine around ``ppo_loss`` needs GPUs; the gradient clip
and skip rules are torch's functions that verl's ``fsdp2_clip_grad_norm_`` calls.
"""

from __future__ import annotations

import pytest

from tests.helpers.train_local_runs import compose, write_gsm8k_parquet


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("numbers")
    return {"model": tiny_model, "train": write_gsm8k_parquet(d / "train.parquet"), "dir": d}


def _trainer(assets, tmp_path, overrides):
    from pipeline_steps.local import grpo_cpu

    cfg = compose(assets, tmp_path / "run", ["trainer.total_training_steps=1", *overrides])
    return grpo_cpu.GRPOTrainer(cfg, reward_fn=lambda *a, **k: 0.0)


def _batch(trainer, seed=3):
    """A real rollout of 2 prompts x n, with scores that differ within each group, and its old log-probs."""
    import torch

    batch = trainer.generate(trainer.train_prompts[:2], trainer.n, temperature=1.0, top_p=1.0, top_k=-1, seed=seed)
    # responses that end early (as if at EOS), each micro-batch of 2 shorter than response_length: verl pads a
    # micro-batch to its longest response only, which seq-mean-token-sum-norm divides by
    width, p_len = batch["responses"].shape[1], batch["prompts"].shape[1]
    for i in range(batch["responses"].shape[0]):
        cut = max(1, width - 3 - i)
        batch["responses"][i, cut:] = trainer.pad_id
        batch["response_mask"][i, cut:] = 0
        batch["attention_mask"][i, p_len + cut :] = 0
        batch["input_ids"][i, p_len + cut :] = trainer.pad_id
    g = torch.Generator().manual_seed(seed)
    scores = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    last = batch["response_mask"].sum(-1).clamp(min=1) - 1
    scores[torch.arange(len(last)), last] = torch.rand(len(last), generator=g)
    batch["token_level_scores"] = scores
    rows = torch.arange(batch["responses"].shape[0])
    with torch.no_grad():
        old, _ = trainer.log_probs(trainer.model, batch, rows)
    # a little off-policy, so that clipping and the ratio matter
    batch["old_log_probs"] = old + 0.3 * torch.randn(old.shape, generator=g) * batch["response_mask"]
    batch["ref_log_prob"] = old - 0.2 * torch.rand(old.shape, generator=g) * batch["response_mask"]
    return batch


@pytest.mark.parametrize(
    "estimator,norm",
    [("grpo", True), ("grpo", False), ("grpo_vectorized", False), ("rloo", True), ("reinforce_plus_plus", True)],
)
def test_advantages_equal_verls_compute_advantage(assets, tmp_path, estimator, norm):
    """grpo_vectorized with norm_adv_by_std_in_grpo=false still divides by std in verl: so must we."""
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from pipeline_steps.local import grpo_cpu

    with grpo_cpu.process_group():
        trainer = _trainer(
            assets,
            tmp_path,
            [f"algorithm.adv_estimator={estimator}", f"algorithm.norm_adv_by_std_in_grpo={str(norm).lower()}"],
        )
        batch = _batch(trainer)
        trainer.advantages(batch)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": batch["token_level_scores"], "response_mask": batch["response_mask"]},
        non_tensors={"uid": np.array(batch["uids"], dtype=object)},
    )
    expected = compute_advantage(
        data,
        adv_estimator=estimator,
        num_repeat=trainer.n,
        norm_adv_by_std_in_grpo=norm,
        config=trainer.algo_cfg,
    ).batch["advantages"]
    assert torch.allclose(batch["advantages"], expected, atol=1e-6), (batch["advantages"][:, 0], expected[:, 0])
    assert batch["advantages"].abs().sum() > 0  # the scores differ within groups: a zero advantage would pass too


def test_estimators_verl_cannot_run_on_these_inputs_are_refused_in_one_line(assets, tmp_path):
    from pipeline_steps.errors import UserError
    from pipeline_steps.local import grpo_cpu

    for estimator, needs in (("gdpo", "gdpo_reward_keys"), ("remax", "reward_baselines"), ("gae", "values")):
        with grpo_cpu.process_group(), pytest.raises(UserError) as err:
            _trainer(assets, tmp_path / estimator, [f"algorithm.adv_estimator={estimator}"])
        msg = str(err.value)
        assert "\n" not in msg and estimator in msg and needs in msg and "grpo" in msg, msg


@pytest.mark.parametrize(
    "key,value",
    [("algorithm.filter_groups.enable", "true"), ("data.train_max_samples", "8")],
)
def test_settings_the_cpu_trainer_does_not_reproduce_are_refused(assets, tmp_path, key, value):
    from pipeline_steps.errors import UserError
    from pipeline_steps.local import grpo_cpu

    with grpo_cpu.process_group(), pytest.raises(UserError, match="not reproduced by the local CPU backend"):
        _trainer(assets, tmp_path, [f"{key}={value}"])


def _value(metric) -> float:
    (value,) = metric.values  # one micro-batch's figure
    return float(value)


def _verl_update_figures(trainer, model, batch, mini: int, micro: int):
    """pg_loss, kl_loss, entropy_loss summed over micro-batches and the pre-clip grad norm of each mini-batch, from
    verl's ppo_loss on the nested micro-batches the v1 worker builds."""
    import torch
    from tensordict import TensorDict
    from torch.nn.utils.clip_grad import _get_total_norm
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    nested = tu.nested_tensor_from_tensor_list
    cfg = trainer.actor_cfg
    mask, total = batch["response_mask"], batch["responses"].shape[0]
    p_len = batch["prompts"].shape[1]
    out = {"pg": 0.0, "kl": 0.0, "ent": 0.0, "grad_norm": []}
    for start in range(0, total, mini):
        rows_mb = torch.arange(start, min(start + mini, total))
        model.zero_grad()
        for m0 in range(0, len(rows_mb), micro):
            rows = rows_mb[m0 : m0 + micro]
            attn = batch["attention_mask"][rows]
            plens, rlens = attn[:, :p_len].sum(-1), attn[:, p_len:].sum(-1)
            logp, ent = trainer.log_probs(model, batch, rows, with_entropy=True)

            def flat(x, plens=plens, rlens=rlens):  # per sequence: prompt positions, then response, shifted by one
                return nested(
                    [
                        torch.cat([x.new_zeros(int(p) - 1), x[i, : int(r)], x.new_zeros(1)])
                        for i, (p, r) in enumerate(zip(plens, rlens))
                    ]
                )

            def jag(key, rows=rows, rlens=rlens):
                return nested([batch[key][i, : int(r)] for i, r in zip(rows.tolist(), rlens)])

            data = TensorDict(
                {
                    "prompts": nested([batch["prompts"][i, -int(p) :] for i, p in zip(rows.tolist(), plens)]),
                    "responses": jag("responses"),
                    "response_mask": jag("response_mask"),
                    "old_log_probs": jag("old_log_probs"),
                    "advantages": jag("advantages"),
                    "ref_log_prob": jag("ref_log_prob"),
                },
                batch_size=[len(rows)],
            )
            tu.assign_non_tensor(
                data, dp_size=1, batch_num_tokens=int(mask[rows_mb].sum()), global_batch_size=len(rows_mb)
            )
            loss, metrics = ppo_loss(cfg, {"log_probs": flat(logp), "entropy": flat(ent)}, data)
            loss.backward()
            out["pg"] += _value(metrics["actor/pg_loss"])
            out["ent"] += _value(metrics["actor/entropy_loss"])
            out["kl"] += _value(metrics["kl_loss"])
        norm = _get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        out["grad_norm"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean"])
def test_update_losses_and_grad_norm_equal_verls_ppo_loss(assets, tmp_path, mode):
    """Four micro-batches of 2 in one mini-batch of 8 (n=4, 2 prompts; one mini-batch, so one optimiser step comes
    after every figure compared): gradient accumulation, the global-batch scaling, the KL and entropy terms, and
    seq-mean-token-sum-norm's per-micro-batch horizon, against verl's worker loss."""
    from pipeline_steps.local import grpo_cpu

    overrides = [
        "actor_rollout_ref.rollout.n=4",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.loss_agg_mode={mode}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.optim.clip_grad=1e9",  # no clipping: the optimiser step leaves the figures as they are
    ]
    with grpo_cpu.process_group():
        trainer = _trainer(assets, tmp_path, overrides)
        batch = _batch(trainer)
        trainer.advantages(batch)
        # verl's loss first, on the same (FSDP-wrapped) model without an optimiser step; update() zeroes the grads
        expected = _verl_update_figures(trainer, trainer.model, batch, mini=8, micro=2)
        got = trainer.update(batch)
    lengths = batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(-1).tolist()
    assert len(set(lengths)) > 1, lengths  # responses of different lengths: the horizon is per micro-batch
    assert got["actor/pg_loss"] == pytest.approx(expected["pg"], rel=1e-4, abs=1e-7)
    assert got["actor/kl_loss"] == pytest.approx(expected["kl"], rel=1e-4, abs=1e-7)
    assert got["actor/entropy_loss"] == pytest.approx(expected["ent"], rel=1e-4, abs=1e-7)
    assert [got["actor/grad_norm"]] == pytest.approx(expected["grad_norm"], rel=1e-4)


def test_sampling_follows_temperature_not_do_sample(assets, tmp_path):
    """verl's v1 rollout reads temperature/top_p only: do_sample=false with temperature 1 still samples (n=4 answers
    differ), temperature 0 is greedy (n=4 identical answers)."""
    from pipeline_steps.local import grpo_cpu

    with grpo_cpu.process_group():
        trainer = _trainer(assets, tmp_path, ["actor_rollout_ref.rollout.do_sample=false"])
        sampled = trainer.generate(trainer.train_prompts[:1], 4, temperature=1.0, top_p=1.0, top_k=-1, seed=1)
        greedy = trainer.generate(trainer.train_prompts[:1], 4, temperature=0.0, top_p=1.0, top_k=-1, seed=1)
    assert len({tuple(r) for r in sampled["responses"].tolist()}) > 1
    assert len({tuple(r) for r in greedy["responses"].tolist()}) == 1


def test_critic_warmup_skips_the_actor_update_as_verl_does(assets, tmp_path):
    """verl updates the actor once ``critic_warmup <= global_steps``: with critic_warmup=2, step 1 leaves the
    weights as they were."""
    import torch

    from pipeline_steps.local import grpo_cpu

    with grpo_cpu.process_group():
        trainer = _trainer(assets, tmp_path, ["trainer.critic_warmup=2"])
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        metrics = trainer.train_step(1)
        same = all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert same and "actor/pg_loss" not in metrics


def test_length_metrics_are_against_the_longest_in_the_batch_as_verls_v1_pads(assets, tmp_path):
    """verl's v1 trainer pads nested responses to the batch's longest before compute_data_metrics: one response of
    eight at the longest length gives response_length/clip_ratio 1/8 even though none reached response_length."""
    from tensordict import TensorDict
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.utils import tensordict_utils as tu

    from pipeline_steps.local import grpo_cpu

    with grpo_cpu.process_group():
        trainer = _trainer(assets, tmp_path, ["actor_rollout_ref.rollout.n=4"])
        batch = _batch(trainer)
        trainer.advantages(batch)
        batch["num_turns"] = [2] * batch["responses"].shape[0]
        got = trainer._metrics(batch, {"gen": 1.0, "step": 1.0}, 1, 0, {})
    # verl's side: the nested batch the v1 trainer holds, padded by tensordict as its _compute_metrics pads it
    p_w = batch["prompts"].shape[1]
    attn = batch["attention_mask"]
    p_len, r_len = attn[:, :p_w].sum(-1), attn[:, p_w:].sum(-1)
    rows = range(len(r_len))
    nested = {
        "prompts": [batch["prompts"][i, p_w - int(p_len[i]) :] for i in rows],
        **{
            k: [batch[k][i, : int(r_len[i])] for i in rows]
            for k in ("responses", "response_mask", "token_level_scores", "token_level_rewards", "advantages")
        },
    }
    nested["returns"] = [batch["returns"][i, : int(r_len[i])] for i in rows]
    data = TensorDict({k: tu.nested_tensor_from_tensor_list(v) for k, v in nested.items()}, batch_size=[len(r_len)])
    data = data.to_padded_tensor()
    data["prompt_length"], data["response_length"] = p_len.float(), r_len.float()
    expected = compute_data_metrics(DataProto(batch=data), use_critic=False)
    assert int(r_len.max()) < trainer.response_length  # no response reached the configured length
    for key in ("response_length/clip_ratio", "prompt_length/clip_ratio", "response_length/mean", "critic/score/mean"):
        assert got[key] == pytest.approx(expected[key]), key
    assert got["response_length/clip_ratio"] == pytest.approx(1 / 8)


def test_gradient_is_clipped_to_grad_clip_and_a_non_finite_gradient_skips_the_step(assets, tmp_path):
    """verl's v1 engine step: clip the total norm to ``actor.optim.clip_grad`` (the logged grad_norm is the norm
    before the clip), and on a non-finite norm skip the optimiser step (weights unchanged)."""
    import math

    import torch
    from torch.nn.utils.clip_grad import _get_total_norm

    from pipeline_steps.local import grpo_cpu

    def norm_now(model):
        n = _get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        return float(n.full_tensor() if hasattr(n, "full_tensor") else n)

    with grpo_cpu.process_group():
        trainer = _trainer(assets, tmp_path, ["actor_rollout_ref.actor.optim.clip_grad=0.001"])
        batch = _batch(trainer)
        trainer.advantages(batch)
        at_step = []
        real_step = trainer.optimizer.step
        trainer.optimizer.step = lambda *a, **k: at_step.append(norm_now(trainer.model)) or real_step(*a, **k)
        got = trainer.update(batch)
        assert got["actor/grad_norm"] > 0.01 and at_step == [pytest.approx(0.001, rel=1e-3)], (got, at_step)

        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        batch["advantages"][0, 0] = float("nan")  # a fault: a non-finite gradient
        at_step.clear()
        got = trainer.update(batch)
        unchanged = all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert math.isnan(got["actor/grad_norm"]) and at_step == [] and unchanged
