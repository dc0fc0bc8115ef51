"""GRPO learns from the reward, and only from the reward: the CPU trainer on the synthetic arithmetic dataset.

Real everything: the tiny model as ``build-tiny-model`` makes it (format warm-up only), the dataset's rows converted
by the registry's ``gsm8k`` preprocessor, verl's GSM8K scorer, the ``local_arithmetic`` preset composed by verl's
Hydra config, fixed seeds. The learning run's mean reward over its last K steps must beat its first K steps by
MARGIN. The control run is the same run with every reward replaced by a constant: GRPO's advantages are then zero,
and the accuracy of its rollouts (scored on the side with the real scorer) must not rise by that margin.
"""

from __future__ import annotations

from pathlib import Path

import pytest

STEPS = 60
K = 10  # steps averaged at each end
MARGIN = 0.05  # mean reward (accuracy) of the last K steps minus the first K


def _write_split(path: Path, items, split: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline_steps.data.preprocessors import gsm8k
    from pipeline_steps.local import synthetic

    rows = [gsm8k.convert_row(synthetic._row(item), split, i, gsm8k.DATA_SOURCE) for i, item in enumerate(items)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny model exactly as build-tiny-model and stage-model make it (with its format warm-up)."""
    from pipeline_steps.local import tiny_model

    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    from pipeline_steps.local import synthetic

    train, _ = synthetic.splits(900)
    return _write_split(tmp_path_factory.mktemp("arithmetic") / "train.parquet", train, "train")


def _run(tiny_model, train_file, out: Path, reward_fn=None) -> list[dict]:
    from pipeline_steps.local import grpo_cpu
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    derived = train_local.derived_keys([train_file], [], tiny_model, out)
    overrides = [f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1"]
    cfg = experiment.compose(experiment.load("local_arithmetic", overrides, derived=derived))
    grpo_cpu.train(cfg, reward_fn=reward_fn, metrics_path=out / "metrics.jsonl")
    return [r["data"] for r in grpo_cpu.read_metrics(out / "metrics.jsonl")]


def _ends(values: list[float]) -> tuple[float, float]:
    return sum(values[:K]) / K, sum(values[-K:]) / K


@pytest.mark.slow
def test_grpo_reward_rises_and_a_constant_reward_teaches_nothing(tiny_model, train_file, tmp_path):
    from verl.utils.reward_score import default_compute_score

    steps = _run(tiny_model, train_file, tmp_path / "learn")
    assert len(steps) == STEPS
    first, last = _ends([s["critic/score/mean"] for s in steps])
    assert last - first > MARGIN, f"mean reward of the first {K} steps {first:.3f}, of the last {K} {last:.3f}"

    accuracy: list[float] = []  # per rollout, in order: the real score of what the control policy generated

    def constant(data_source, solution_str, ground_truth, extra_info=None):
        accuracy.append(float(default_compute_score(data_source, solution_str, ground_truth, extra_info)))
        return 1.0

    control = _run(tiny_model, train_file, tmp_path / "control", reward_fn=constant)
    assert {s["critic/score/mean"] for s in control} == {1.0}
    assert {s["critic/advantages/max"] for s in control} == {0.0}  # nothing to learn from
    per_step = len(accuracy) // STEPS
    step_acc = [sum(accuracy[i * per_step : (i + 1) * per_step]) / per_step for i in range(STEPS)]
    c_first, c_last = _ends(step_acc)
    assert c_last - c_first < MARGIN, f"control: accuracy {c_first:.3f} -> {c_last:.3f} with a constant reward"
    # the learning run's first steps and the control's start from the same model: the same accuracy, give or take
    assert abs(c_first - first) < MARGIN
    print(
        f"learning: {first:.3f} -> {last:.3f} ({last - first:+.3f}); "
        f"constant-reward control: {c_first:.3f} -> {c_last:.3f} ({c_last - c_first:+.3f}); margin {MARGIN}"
    )
