"""Scoring by data source (pipeline_steps/evaluation/scoring.py): verl's default_compute_score, as training scores."""

import pytest

from pipeline_steps.evaluation import scoring
from tests.helpers.eval_rows import converted_geo3k_rows as geo3k_rows


def test_geometry3k_is_scored_by_verls_geo3k_scorer_and_a_well_formed_wrong_answer_is_wrong():
    """verl's geo3k score is 0.9 x accuracy + 0.1 x format: 'correct' must be the accuracy, not score > 0."""
    from verl.utils.reward_score import default_compute_score

    right, wrong, bare = "<think>sum</think> \\boxed{31}", "<think>sum</think> \\boxed{32}", "x is \\boxed{31}"
    assert default_compute_score("hiyouga/geometry3k", wrong, "31") == pytest.approx(0.1)  # the library's own
    got = {t: scoring.score_sample("hiyouga/geometry3k", t, "31") for t in (right, wrong, bare, "no box")}
    assert got[right] == {"answer": "31", "correct": True, "score": 1.0}
    assert got[wrong] == {"answer": "32", "correct": False, "score": pytest.approx(0.1)}
    assert got[bare]["correct"] is True and got[bare]["score"] == pytest.approx(0.9)  # right answer, no <think>
    assert got["no box"] == {"answer": None, "correct": False, "score": 0.0}
    rows = geo3k_rows(2)[1:]  # ground truth 31
    res = scoring.score(rows, [[wrong, wrong, right]])
    assert res["problems"][0]["maj_answer"] == "32" and res["overall"]["avg@k"] == pytest.approx(1 / 3)
