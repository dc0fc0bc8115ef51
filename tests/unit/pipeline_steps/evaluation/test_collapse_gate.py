"""The collapse check: a model that learned only the prior is refused, whatever its avg@k; a varied, correct one passes.

Real scoring: responses in GSM8K's ``#### N`` form are scored by ``scoring.score`` (verl's GSM8K reward) on an
evaluation set whose answers are skewed the way the old demo's were (30% of the answers are 9). The untuned baseline
is the best constant answer: always answering 9 scores 30%, which beats a base model that guesses uniformly (10%), so
a gate that only compares avg@k with the base promotes it.
"""

from __future__ import annotations

import random

from pipeline_steps.evaluation import metrics, promotion, scoring
from pipeline_steps.evaluation.model_card import eval_table

K = 4
# 100 problems: 30 answers are 9, the other 70 spread over 0..8
TRUTHS = ["9"] * 30 + [str(i % 9) for i in range(70)]


def _results(responses_for) -> dict:
    rows = [
        {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": gt}, "extra_info": {"index": i}}
        for i, gt in enumerate(TRUTHS)
    ]
    res = scoring.score(rows, [responses_for(i, gt) for i, gt in enumerate(TRUTHS)])
    res.update(
        eval_set={"sha256": "e" * 64, "name": "skewed"},
        sampling={"k": K, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4, "max_problems": 0},
    )
    return res


def _base():
    rng = random.Random(0)  # a format-only model: a uniform guess over 0..9
    return _results(lambda i, gt: [f"#### {rng.randrange(10)}" for _ in range(K)])


def test_a_constant_answer_model_is_refused_with_the_collapse_reason():
    base = _base()
    constant = _results(lambda i, gt: ["#### 9"] * K)
    f = metrics.figures_of(constant)
    assert f["best_constant"] == 0.3 and f["modal_ground_truth"] == "9" and f["non_modal_problems"] == 70
    assert f["non_modal_avg@k"] == 0.0 and f["majority_distinct"] == 1 and f["majority_top_share"] == 1.0
    # the old gate's comparison alone promotes it: 30% beats the base's guessing by far
    assert constant["overall"]["avg@k"] == 0.3 > base["overall"]["avg@k"] + 0.1
    d = promotion.decide(constant, base, None, margin=0.0)
    assert not d.promote and "collapse" in d.reason and "best constant answer" in d.reason, d.reason
    assert "\n" not in d.reason
    # switched off per preset, the same model is promoted on avg@k alone
    assert promotion.decide(constant, base, None, margin=0.0, collapse_check=False).promote
    table = eval_table(constant, base)
    assert "Best constant answer: `9` every time scores **30.0%**" in table
    assert "| distinct majority answers | 1 |" in table


def test_beating_the_constant_but_not_the_base_off_the_prior_is_refused():
    """Mostly 9 plus a little skill elsewhere: avg@k clears the best constant, non-modal accuracy stays below the
    base's, so the second figure names the failure."""
    base = _results(lambda i, gt: [f"#### {gt}", "#### 0", "#### 1", "#### 2"])  # 25% everywhere
    prior = _results(lambda i, gt: ["#### 9", "#### 9", "#### 9", f"#### {gt}"])  # 100% on 9s, 25% elsewhere
    f, b = metrics.figures_of(prior), metrics.figures_of(base)
    assert prior["overall"]["avg@k"] > f["best_constant"] + promotion.COLLAPSE_MARGIN
    d = promotion.decide(prior, base, None, margin=0.0)
    assert not d.promote and "collapse" in d.reason and "not above the base model's" in d.reason, d.reason
    assert f["non_modal_avg@k"] <= b["non_modal_avg@k"]


def test_a_varied_correct_model_passes():
    base = _base()
    good = _results(lambda i, gt: [f"#### {gt}"] * 3 + ["#### 9"])  # right 3 times of 4, whatever the answer
    f = metrics.figures_of(good)
    assert f["majority_distinct"] == 10 and f["non_modal_avg@k"] == 0.75
    d = promotion.decide(good, base, None, margin=0.0)
    assert d.promote and d.reference == "base", d.reason


def test_old_results_without_figures_are_computed_from_their_problems_or_refused():
    base, good = _base(), _results(lambda i, gt: [f"#### {gt}"] * K)
    for r in (base, good):
        del r["overall"]["answers"]  # results.json written before the figures existed
    assert promotion.decide(good, base, None, margin=0.0).promote
    bare = {"overall": dict(good["overall"]), "eval_set": good["eval_set"], "sampling": good["sampling"]}
    d = promotion.decide(bare, base, None, margin=0.0)
    assert not d.promote and "collapse check impossible" in d.reason
