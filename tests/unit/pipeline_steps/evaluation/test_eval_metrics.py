"""Evaluation arithmetic on crafted generations: avg@k, unbiased pass@k, maj@k and its tie rule.

The scoring tests run verl's real reward code (``default_compute_score`` -> ``math_dapo``)
on hand-written responses, so they also pin what "correct" means for AIME rows.
"""

import math
import random

import pytest

from pipeline_steps.evaluation import metrics as em
from pipeline_steps.evaluation.scoring import score, score_sample


def comb_pass_at_k(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n,c,k", [(4, 1, 2), (10, 3, 1), (10, 3, 5), (30, 7, 8), (30, 0, 30), (16, 16, 1), (5, 2, 4)])
def test_pass_at_k_matches_binomial_formula(n, c, k):
    assert em.pass_at_k(n, c, k) == pytest.approx(comb_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_known_values_and_edges():
    assert em.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert em.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain accuracy
    assert em.pass_at_k(8, 0, 8) == 0.0
    assert em.pass_at_k(8, 1, 8) == 1.0  # with k = n one correct sample suffices
    assert em.pass_at_k(5, 3, 3) == 1.0  # n - c < k: every draw of 3 holds a correct one
    with pytest.raises(ValueError):
        em.pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        em.pass_at_k(4, 5, 1)


def test_majority_vote_clear_winner():
    assert em.majority_vote(["7", "7", "3", "7"], [True, True, False, True])["score"] == 1.0
    wrong = em.majority_vote(["3", "3", "7", "3"], [False, False, True, False])
    assert wrong["score"] == 0.0 and wrong["answer"] == "3"


def test_majority_vote_tie_rule_is_expected_accuracy_of_a_random_pick():
    two_way = em.majority_vote(["7", "3", "7", "3"], [True, False, True, False])
    assert two_way["score"] == 0.5 and two_way["tied"] == ["3", "7"] and two_way["answer"] is None
    three_way = em.majority_vote(["1", "2", "3"], [False, True, False])
    assert three_way["score"] == pytest.approx(1 / 3)
    none_right = em.majority_vote(["1", "2"], [False, False])
    assert none_right["score"] == 0.0


def test_majority_vote_ignores_unextracted_answers_and_order():
    answers = [None, "[INVALID]", None, "5", ""]
    correct = [False, False, False, True, False]
    assert em.majority_vote(answers, correct)["score"] == 1.0  # the only vote is the right one
    assert em.majority_vote([None, None], [False, False]) == {"answer": None, "tied": [], "votes": 0, "score": 0.0}
    rng = random.Random(0)
    base = list(zip(["4", "4", "9", "9", "9", "2"], [True, True, False, False, False, False]))
    ref = em.majority_vote(*zip(*base))["score"]
    for _ in range(5):
        rng.shuffle(base)
        assert em.majority_vote(*zip(*base))["score"] == ref == 0.0


def test_problem_metrics_and_aggregate():
    p1 = em.problem_metrics(["7", "7", "3", "7"], [True, True, False, True])
    p2 = em.problem_metrics(["1", None, "2", "2"], [False, False, False, False])
    assert (p1["avg"], p1["pass"]["1"], p1["pass"]["4"], p1["maj"]) == (0.75, 0.75, 1.0, 1.0)
    assert set(p1["pass"]) == {"1", "2", "4"}
    assert p1["pass"]["2"] == pytest.approx(1.0)  # 1 wrong of 4: every pair holds a right one
    overall = em.aggregate([p1, p2])
    assert overall["samples_scored"] == 8 and overall["k"] == 4 and overall["problems"] == 2
    assert overall["avg@k"] == pytest.approx(0.375)
    assert overall["pass@k"]["4"] == pytest.approx(0.5)
    assert overall["maj@k"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        em.aggregate([p1, em.problem_metrics(["1"], [True])])  # unequal k is a bug upstream


def test_verl_scoring_of_crafted_aime_generations():
    row = {
        "data_source": "aime2024",
        "reward_model": {"ground_truth": "204"},
        "extra_info": {"index": 0, "id": "2024-I-1"},
    }
    texts = [
        "We compute carefully.\nAnswer: 204",  # Minerva-style line: correct
        "so the total is \\boxed{204}",  # no Answer line: verl falls back to \\boxed{}
        "Answer: 205",  # wrong
        "I give up",  # nothing extracted
    ]
    res = score([row], [texts])
    p = res["problems"][0]
    assert [s["correct"] for s in p["samples"]] == [True, True, False, False]
    assert [s["answer"] for s in p["samples"]] == ["204", "204", "205", None]
    assert p["samples"][2]["score"] == -1.0 and p["samples"][0]["score"] == 1.0
    assert p["avg@k"] == 0.5 and p["maj@k"] == 1.0 and p["maj_answer"] == "204"
    assert res["overall"]["pass@k"]["4"] == 1.0 and res["overall"]["samples_scored"] == 4


def test_unknown_data_source_is_a_clear_error():
    from pipeline_steps.errors import UserError

    with pytest.raises(UserError, match="no reward function"):
        score_sample("my_unknown_source", "Answer: 1", "1")
