"""Scoring by data source: each sample through verl's ``default_compute_score``, exactly what the training reward
uses (AIME rows route to ``math_dapo``, geometry3k to ``geo3k``, GSM8K to ``gsm8k``), then the arithmetic of
:mod:`pipeline_steps.evaluation.metrics`."""

from __future__ import annotations

from pipeline_steps.errors import UserError
from pipeline_steps.evaluation import metrics as eval_metrics

SCORER = "verl.utils.reward_score.default_compute_score"
GEO3K_SOURCE = "hiyouga/geometry3k"  # default_compute_score's key for verl.utils.reward_score.geo3k


def score_sample(data_source: str, response: str, ground_truth: str, extra_info=None) -> dict:
    """verl's reward for one sample -> {"answer", "correct", "score"}."""
    from verl.utils.reward_score import default_compute_score

    try:
        res = default_compute_score(data_source, response, ground_truth, extra_info=extra_info)
    except NotImplementedError:
        raise UserError(
            f"data_source {data_source!r} has no reward function in verl's default_compute_score; "
            "set the eval set's data_source to one verl knows (AIME: aime2024)"
        ) from None
    if isinstance(res, dict):  # math_dapo: {"score": +-1, "acc": bool, "pred": str}
        answer = res.get("pred")
        correct = bool(res.get("acc", res.get("score", 0) > 0))
        return {
            "answer": None if answer in eval_metrics.INVALID else answer,
            "correct": correct,
            "score": float(res.get("score", 0)),
        }
    if data_source == GEO3K_SOURCE:  # 0.9 x accuracy + 0.1 x format: a well-formed wrong answer scores 0.1
        from mathruler.grader import extract_boxed_content
        from verl.utils.reward_score import geo3k

        answer = extract_boxed_content(response)
        return {
            "answer": None if answer in ("None", "") else answer.strip(),
            "correct": geo3k.acc_reward(response, ground_truth) > 0,
            "score": float(res),
        }
    answer = None
    if data_source == "openai/gsm8k":  # a bare score; verl's own GSM8K extractor gives the answer maj@k votes on
        from verl.utils.reward_score.gsm8k import extract_solution

        answer = extract_solution(response)
    return {"answer": answer, "correct": float(res) > 0, "score": float(res)}


def score(rows: list[dict], generations: list[list[str]]) -> dict:
    """Every problem's samples scored, and the overall figures (avg@k, pass@k, maj@k, the answer figures)."""
    problems = []
    for i, (row, texts) in enumerate(zip(rows, generations)):
        gt = str(row["reward_model"]["ground_truth"])
        extra = row.get("extra_info") or {}
        samples = [score_sample(row["data_source"], t, gt, extra) for t in texts]
        pid = str(extra.get("id", extra.get("index", i)))
        problems.append(eval_metrics.problem_record(pid, extra.get("index", i), row["data_source"], gt, samples))
    return eval_metrics.results_of(problems)
