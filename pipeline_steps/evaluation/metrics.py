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
