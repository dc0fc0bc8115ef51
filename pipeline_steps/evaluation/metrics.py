"""Evaluation arithmetic: avg@k, pass@k (unbiased estimator) and maj@k over scored samples.

Inputs are plain lists so the arithmetic is testable on crafted generations:
per problem, ``correct`` (one bool per sample, as verl's reward code judged it) and
``answers`` (the answer verl extracted from each sample, ``None`` when it found none).

- avg@k: mean accuracy over all k samples of a problem (then over problems).
- pass@k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
  Models Trained on Code"), ``1 - C(n-c, k) / C(n, k)`` for n samples with c correct,
  computed as a stable product. Reported for every power of two up to n and for n.
- maj@k: majority vote over the extracted answers. Samples with no extracted answer
  do not vote. Tie rule: when t distinct answers share the top count, the vote is
  scored as the expected accuracy of a uniform random pick among them, i.e.
  (number of correct answers among the tied) / t. The result is deterministic and
  independent of sample order, and it does not reward a model for splitting votes.
- answer figures (:func:`answer_figures`): what a model that learned only the prior would score. The best
  constant answer is the most common ground truth; answering it every time scores its share (``best_constant``).
  ``non_modal_avg@k`` is avg@k on the problems whose ground truth is NOT that answer, where always answering the
  prior scores 0. ``majority_distinct`` counts the distinct majority answers over the problems and
  ``majority_top_share`` is the share of problems whose majority answer is the model's most common one, to set
  beside ``ground_truth_top_share``: a collapsed model has one majority answer for every problem.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

INVALID = {None, "", "[INVALID]"}  # math_dapo returns "[INVALID]" when it finds no "Answer:" line


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for n samples of which c are correct (requires 1 <= k <= n)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k/i): equal to 1 - C(n-c,k)/C(n,k) without huge binomials
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_vote(answers: Sequence[str | None], correct: Sequence[bool]) -> dict:
    """maj@k for one problem: the voted answer(s) and the score under the tie rule above."""
    if len(answers) != len(correct):
        raise ValueError("answers and correct must have the same length")
    votes = Counter(a for a in answers if a not in INVALID)
    if not votes:
        return {"answer": None, "tied": [], "votes": 0, "score": 0.0}
    top = max(votes.values())
    tied = sorted(a for a, v in votes.items() if v == top)
    right = {a for a, ok in zip(answers, correct) if ok and a not in INVALID}
    score = sum(1 for a in tied if a in right) / len(tied)
    return {"answer": tied[0] if len(tied) == 1 else None, "tied": tied, "votes": top, "score": score}


def ks_to_report(n: int) -> list[int]:
    """pass@j is reported for j = 1, 2, 4, ... < n and for n itself."""
    ks, j = [], 1
    while j < n:
        ks.append(j)
        j *= 2
    ks.append(n)
    return ks


def problem_metrics(answers: Sequence[str | None], correct: Sequence[bool]) -> dict:
    n = len(correct)
    if n < 1:
        raise ValueError("a problem needs at least one scored sample")
    c = sum(bool(x) for x in correct)
    maj = majority_vote(answers, correct)
    return {
        "n": n,
        "correct": c,
        "avg": c / n,
        "pass": {str(j): pass_at_k(n, c, j) for j in ks_to_report(n)},
        "maj": maj["score"],
        "maj_answer": maj["answer"],
        "maj_tied": maj["tied"],
    }


def aggregate(per_problem: Sequence[dict]) -> dict:
    """Overall metrics: unweighted means over problems (every problem counts the same)."""
    if not per_problem:
        raise ValueError("no problems to aggregate")
    ns = {p["n"] for p in per_problem}
    if len(ns) != 1:
        raise ValueError(f"every problem must have the same number of samples, got {sorted(ns)}")
    n = ns.pop()
    m = len(per_problem)
    return {
        "problems": m,
        "k": n,
        "samples_scored": sum(p["n"] for p in per_problem),
        "avg@k": sum(p["avg"] for p in per_problem) / m,
        "pass@k": {j: sum(p["pass"][j] for p in per_problem) / m for j in per_problem[0]["pass"]},
        "maj@k": sum(p["maj"] for p in per_problem) / m,
    }


def _top(values: Sequence[str]) -> tuple[str | None, int]:
    """The most common value and its count; ties go to the smallest value (deterministic)."""
    counts = Counter(values)
    if not counts:
        return None, 0
    top = max(counts.values())
    return min(v for v, c in counts.items() if c == top), top


def answer_figures(per_problem: Sequence[dict]) -> dict:
    """The prior baseline and the answer distribution of one evaluation (see the module doc).

    ``per_problem``: dicts with ``ground_truth``, ``avg`` (avg@k of the problem) and ``maj_answer`` (None when the
    vote found no answer or tied).
    """
    if not per_problem:
        raise ValueError("no problems to aggregate")
    m = len(per_problem)
    truths = [str(p["ground_truth"]).strip() for p in per_problem]
    modal, modal_count = _top(truths)
    rest = [p for p, t in zip(per_problem, truths) if t != modal]
    majority = [str(p["maj_answer"]).strip() for p in per_problem if p.get("maj_answer") is not None]
    top_answer, top_count = _top(majority)
    return {
        "modal_ground_truth": modal,
        "ground_truth_distinct": len(set(truths)),
        "ground_truth_top_share": modal_count / m,
        "best_constant": modal_count / m,  # avg@k of always answering the most common ground truth
        "non_modal_problems": len(rest),
        "non_modal_avg@k": sum(p["avg"] for p in rest) / len(rest) if rest else None,
        "majority_distinct": len(set(majority)),
        "majority_top": top_answer,
        "majority_top_share": top_count / m,
    }


def figures_of(results: dict) -> dict | None:
    """The answer figures of an evaluate ``results.json``: as recorded, else computed from its problems (results
    written before the figures existed); None when it has neither."""
    overall = results.get("overall") if isinstance(results, dict) else None
    if isinstance(overall, dict) and isinstance(overall.get("answers"), dict):
        return overall["answers"]
    problems = results.get("problems") if isinstance(results, dict) else None
    if not problems or not all(isinstance(p, dict) and "ground_truth" in p and "avg@k" in p for p in problems):
        return None
    return answer_figures(
        [{"ground_truth": p["ground_truth"], "avg": p["avg@k"], "maj_answer": p.get("maj_answer")} for p in problems]
    )


def problem_record(pid: str, index, data_source: str, ground_truth: str, samples: Sequence[dict]) -> dict:
    """One problem of ``results.json``: its scored samples (``answer``, ``correct``, ``score``) and their figures."""
    m = problem_metrics([x["answer"] for x in samples], [x["correct"] for x in samples])
    return {
        "id": pid,
        "index": index,
        "data_source": data_source,
        "ground_truth": ground_truth,
        "samples": list(samples),
        "n": m["n"],
        "correct": m["correct"],
        "avg@k": m["avg"],
        "pass@k": m["pass"],
        "maj@k": m["maj"],
        "maj_answer": m["maj_answer"],
        "maj_tied": m["maj_tied"],
    }


def results_of(problems: list[dict]) -> dict:
    """``{"overall", "problems"}`` of ``results.json`` from its problem records (:func:`problem_record`)."""
    overall = aggregate([{"n": p["n"], "avg": p["avg@k"], "pass": p["pass@k"], "maj": p["maj@k"]} for p in problems])
    overall["answers"] = answer_figures(
        [{"ground_truth": p["ground_truth"], "avg": p["avg@k"], "maj_answer": p["maj_answer"]} for p in problems]
    )
    return {"overall": overall, "problems": problems}
