"""GRPO learns a skill that depends on the input, from the reward only: the CPU trainer on the synthetic dataset.

Real everything: the tiny model as ``build-tiny-model`` makes it, the dataset's rows converted by the registry's
``gsm8k`` preprocessor, verl's GSM8K scorer, the ``local_arithmetic`` preset composed by verl's Hydra config, the
evaluate step's generation and scoring, fixed seeds. Measured against untuned baselines: on the held-out split the
trained model must beat the base model by MARGIN on the problems whose answer is not the most common one (a model
that learned only the prior scores 0 there), beat the best constant answer, and pass the promotion gate's collapse
check. The control run is the same run with every reward replaced by a constant: GRPO's advantages are then zero, and
the accuracy of its rollouts (scored on the side with the real scorer) must not rise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

K = 10  # steps averaged at each end of a run
MARGIN = 0.10  # non-modal held-out avg@k over the base's; reward of the last K steps over the first K
SAMPLING = {"k": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4, "seed": 0, "max_problems": 0}


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
    from pipeline_steps.local import tiny_model

    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model")


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
    cfg = experiment.compose(experiment.load("local_arithmetic", [], derived=derived))  # the demo's run
    grpo_cpu.train(cfg, reward_fn=reward_fn, metrics_path=out / "metrics.jsonl")
    return [r["data"] for r in grpo_cpu.read_metrics(out / "metrics.jsonl")], int(cfg.trainer.total_training_steps)


def _ends(values: list[float]) -> tuple[float, float]:
    return sum(values[:K]) / K, sum(values[-K:]) / K


def _evaluate(model: Path, test_file: Path, work: Path) -> dict:
    from pipeline_steps.steps import evaluate

    rows, info = evaluate.load_eval_set(str(test_file))
    return evaluate.evaluate_model(str(model), rows, info, dict(SAMPLING, generator="hf"), work)[0]


LEARNING_GAP = (
    "issue 22 is open: 100 CPU GRPO steps do not yet lift the tiny model 10 points over the base on the non-modal "
    "held-out problems of the synthetic task"
)


@pytest.fixture(scope="module")
def learned(tiny_model, files, tmp_path_factory):
    """The demo's training run (local_arithmetic) and the held-out evaluation of the base and the trained model."""
    train_file, test_file = files
    out = tmp_path_factory.mktemp("learn")
    steps, total = _run(tiny_model, train_file, out / "run")
    base = _evaluate(tiny_model, test_file, out / "w-base")
    trained = _evaluate(out / "run" / "checkpoints", test_file, out / "w-trained")
    return {"steps": steps, "total": total, "base": base, "trained": trained}


@pytest.mark.slow
@pytest.mark.budget(900)
@pytest.mark.xfail(strict=True, reason=LEARNING_GAP)
def test_grpo_learns_the_input_dependent_skill(learned):
    from pipeline_steps.evaluation import promotion
    from pipeline_steps.evaluation.metrics import figures_of

    steps, base, trained = learned["steps"], learned["base"], learned["trained"]
    assert len(steps) == learned["total"]
    first, last = _ends([s["critic/score/mean"] for s in steps])
    assert last - first > MARGIN, f"mean reward of the first {K} steps {first:.3f}, of the last {K} {last:.3f}"
    f, b = figures_of(trained), figures_of(base)
    assert f["non_modal_avg@k"] >= b["non_modal_avg@k"] + MARGIN, (f, b)
    assert trained["overall"]["avg@k"] > f["best_constant"] + MARGIN, (trained["overall"], f)
    assert f["majority_distinct"] >= f["ground_truth_distinct"] - 2, f  # answers follow the question
    assert promotion.collapse(trained, base) is None
    assert promotion.decide(trained, base, None, margin=0.0).promote


@pytest.mark.slow
@pytest.mark.budget(600)
def test_a_constant_reward_teaches_nothing_and_the_gate_sees_what_the_run_learned(learned, tiny_model, files, tmp_path):
    from verl.utils.reward_score import default_compute_score

    from pipeline_steps.evaluation import promotion
    from pipeline_steps.evaluation.metrics import figures_of

    train_file, _ = files
    steps, total = learned["steps"], learned["total"]
    first, last = _ends([s["critic/score/mean"] for s in steps])
    accuracy: list[float] = []  # per rollout, in order: the real score of what the control policy generated

    def constant(data_source, solution_str, ground_truth, extra_info=None):
        accuracy.append(float(default_compute_score(data_source, solution_str, ground_truth, extra_info)))
        return 1.0

    control, _ = _run(tiny_model, train_file, tmp_path / "control", reward_fn=constant)
    assert {s["critic/score/mean"] for s in control} == {1.0}
    assert {s["critic/advantages/max"] for s in control} == {0.0}  # nothing to learn from
    per_step = len(accuracy) // total
    step_acc = [sum(accuracy[i * per_step : (i + 1) * per_step]) / per_step for i in range(total)]
    c_first, c_last = _ends(step_acc)
    assert c_last - c_first < MARGIN / 2, f"control: accuracy {c_first:.3f} -> {c_last:.3f} with a constant reward"
    # the learning run's first steps and the control's start from the same model: the same accuracy, give or take
    assert abs(c_first - first) < MARGIN / 2
    # whatever the run learned, the gate's collapse check agrees with the figures it is computed from
    f, b = figures_of(learned["trained"]), figures_of(learned["base"])
    problem = promotion.collapse(learned["trained"], learned["base"])
    beats = learned["trained"]["overall"]["avg@k"] > f["best_constant"] + promotion.COLLAPSE_MARGIN
    assert (problem is None) == (beats and f["non_modal_avg@k"] > b["non_modal_avg@k"]), (problem, f, b)
    print(
        f"learning: reward {first:.3f} -> {last:.3f}; held-out non-modal avg@k {f['non_modal_avg@k']:.3f} vs base "
        f"{b['non_modal_avg@k']:.3f}, avg@k {learned['trained']['overall']['avg@k']:.3f} vs best constant "
        f"{f['best_constant']:.3f}, {f['majority_distinct']} distinct majority answers; "
        f"constant-reward control: {c_first:.3f} -> {c_last:.3f}; collapse check: {problem}"
    )
