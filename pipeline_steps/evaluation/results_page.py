"""``results.md``, the evaluate step's table: the scores against the base model, then one row per problem.

Problem ids, ground truths, answers, the evaluation set's name and the model's path come from a dataset, a model or
the form: each is escaped for where it lands (:mod:`pipeline_steps.evaluation.markdown`), so a newline in an id
cannot start a heading and an answer's backticks or HTML stay text.
"""

from __future__ import annotations

from pipeline_steps.evaluation.markdown import cell, code
from pipeline_steps.evaluation.model_card import eval_table


def render(res: dict, base: dict | None) -> str:
    model = res.get("model") or {}
    step = model.get("step")
    lines = [
        f"# Evaluation: {cell((res.get('eval_set') or {}).get('name', '?'))}",
        "",
        f"model {code(model.get('path', '?'), table=False)}"
        + (f" (checkpoint step {cell(step)})" if step is not None else ""),
        "",
        eval_table(res, base),
        "",
        "| problem | answer | correct/k | maj answer |",
        "| --- | --- | ---: | --- |",
    ]
    for p in res["problems"]:
        maj = code(p["maj_answer"]) if p.get("maj_answer") is not None else "—"
        lines.append(
            f"| {cell(p.get('id', '?'))} | {code(p.get('ground_truth', '?'))} | "
            f"{cell(p.get('correct', '?'))}/{cell(p.get('n', '?'))} | {maj} |"
        )
    return "\n".join(lines) + "\n"
