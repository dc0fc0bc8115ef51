"""What GRPO learns from comes from the reward only: the CPU trainer on the synthetic dataset, the demo's preset.

Real everything: the tiny model as ``build-tiny-model`` makes it, the dataset's rows converted by the registry's
``gsm8k`` preprocessor, verl's GSM8K scorer, the ``local_arithmetic`` preset composed by verl's Hydra config, fixed
seeds. The control run is the same run with every reward replaced by a constant: GRPO's advantages are then zero, and
the accuracy of its rollouts (scored on the side with the real scorer) must not rise; both runs start from the same
model with the same seed, so their first steps (before any update) score exactly the same. STEPS of each (the
preset's 100-step run, its held-out evaluation against the base and the best constant answer, and the issue-22
learning targets are tests/e2e/test_demo.py's, on ``make demo``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

K = 10  # steps averaged at each end of a run
STEPS = 2 * K  # of each run: the control's two ends do not overlap
MARGIN = 0.10  # the control's accuracy may not rise by half of it


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
    """The tiny model exactly as build-tiny-model and stage-model make it (with its warm-up)."""
    from pipeline_steps import settings
    from pipeline_steps.local import tiny_model

    return tiny_model.build_cached(settings.cache_dir(), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from pipeline_steps.local import synthetic

    root = tmp_path_factory.mktemp("arithmetic")
    train, test = synthetic.splits(900)
    return _write_split(root / "train.parquet", train, "train"), _write_split(root / "test.parquet", test, "test")


def _run(tiny_model, train_file, out: Path, reward_fn=None) -> tuple[list[dict], int]:
    from pipeline_steps.local import grpo_cpu
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    derived = train_local.derived_keys([train_file], [], tiny_model, out)
    steps = [f"trainer.total_training_steps={STEPS}"]
    cfg = experiment.compose(experiment.load("local_arithmetic", steps, derived=derived))  # the demo's run, shorter
    grpo_cpu.train(cfg, reward_fn=reward_fn, metrics_path=out / "metrics.jsonl")
    return [r["data"] for r in grpo_cpu.read_metrics(out / "metrics.jsonl")], int(cfg.trainer.total_training_steps)


def _ends(values: list[float]) -> tuple[float, float]:
    return sum(values[:K]) / K, sum(values[-K:]) / K


@pytest.fixture(scope="module")
def learned(tiny_model, files, tmp_path_factory):
    """The demo's training run, STEPS long."""
    steps, total = _run(tiny_model, files[0], tmp_path_factory.mktemp("learn") / "run")
    assert len(steps) == total == STEPS
    return {"steps": steps, "total": total}


@pytest.mark.slow
@pytest.mark.budget(600)
def test_a_constant_reward_teaches_nothing(learned, tiny_model, files, tmp_path):
    from verl.utils.reward_score import default_compute_score

    steps, total = learned["steps"], learned["total"]
    first, last = _ends([s["critic/score/mean"] for s in steps])
    accuracy: list[float] = []  # per rollout, in order: the real score of what the control policy generated

    def constant(data_source, solution_str, ground_truth, extra_info=None):
        accuracy.append(float(default_compute_score(data_source, solution_str, ground_truth, extra_info)))
        return 1.0

    control, _ = _run(tiny_model, files[0], tmp_path / "control", reward_fn=constant)
    assert {s["critic/score/mean"] for s in control} == {1.0}
    assert {s["critic/advantages/max"] for s in control} == {0.0}  # nothing to learn from
    assert {s["critic/advantages/max"] for s in steps} != {0.0}  # the real reward does give GRPO something
    per_step = len(accuracy) // total
    step_acc = [sum(accuracy[i * per_step : (i + 1) * per_step]) / per_step for i in range(total)]
    c_first, c_last = _ends(step_acc)
    assert c_last - c_first < MARGIN / 2, f"control: accuracy {c_first:.3f} -> {c_last:.3f} with a constant reward"
    # both runs start from the same model with the same seed: their first step, before any update, draws the same
    # rollouts (the ends above already include steps after updates, where the learning run has moved on)
    assert step_acc[0] == steps[0]["critic/score/mean"], (step_acc[0], steps[0]["critic/score/mean"])
    print(f"real reward: {first:.3f} -> {last:.3f}; constant-reward control's accuracy: {c_first:.3f} -> {c_last:.3f}")
