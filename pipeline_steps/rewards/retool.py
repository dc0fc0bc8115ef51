"""ReTool-style reward (guide 003's recipe): the boxed answer's correctness, shaped by tool use.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` once per sample; ``solution_str`` is
the whole multi-turn response (the model's turns and the tools' answers). Score: 1 for a correct final answer
(``\\boxed{}``, or the last ``Answer:`` line the pipeline's DAPO/AIME prompts ask for),
-1 otherwise (ReTool's outcome reward); a correct answer that used the code tool gets ``TOOL_BONUS`` more, and every
tool call whose code failed costs ``ERROR_COST``, so the policy learns to call the tool and to write code that runs.
``extra_info["rollout_extra"]`` (a JSONL row's ``rollout_extra``, guide 002, a dict) may carry ``{"solution": ...}``,
which then wins over ``ground_truth``.
"""

from __future__ import annotations

import re

TOOL_BONUS = 0.1
ERROR_COST = 0.05
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def last_boxed(text: str) -> str | None:
    found = _BOXED.findall(text or "")
    return found[-1].strip() if found else None


_ANSWER_LINE = re.compile(r"^\s*Answer:\s*(.+?)\s*$", re.MULTILINE)


def final_answer(text: str) -> str | None:
    """The last ``\\boxed{}`` (ReTool's format), else the last ``Answer: ...`` line: the pipeline's DAPO-Math and AIME
    rows ask for the latter (verl's math_dapo prompt), and the guide's dataset class is not used here."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text or "")
    return lines[-1] if lines else None


def _normalise(answer) -> str:
    s = str(answer).strip().strip("$").replace(",", "").replace(" ", "")
    return s[:-2] if s.endswith(".0") else s


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    extra = extra_info or {}
    rollout_extra = extra.get("rollout_extra") or {}
    truth = rollout_extra.get("solution") or ground_truth
    answer = final_answer(solution_str)
    correct = answer is not None and _normalise(answer) == _normalise(truth)
    calls = solution_str.count("<tool_call>")
    errors = len(re.findall(r"\[error\]|Error: code sandbox", solution_str))
    score = (1.0 if correct else -1.0) + (TOOL_BONUS if correct and calls else 0.0) - ERROR_COST * errors
    return {"score": score, "acc": float(correct), "tool_calls": float(calls), "tool_errors": float(errors)}


def compute_group_score(data_source, solution_strs, ground_truth, extra_info=None) -> list[dict]:
    """A prompt's whole group at once: the per-sample score, and the shortest correct answer of the group gets the
    tool bonus again (ReTool prefers efficient solutions)."""
    scores = [compute_score(data_source, s, ground_truth, extra_info) for s in solution_strs]
    correct = [i for i, r in enumerate(scores) if r["acc"]]
    if correct:
        best = min(correct, key=lambda i: len(solution_strs[i]))
        scores[best]["score"] += TOOL_BONUS
    return scores
