"""Rollout trajectories: written per training step, read back for the run report.

The files are verl's ``trainer.rollout_data_dir`` dump (``RayPPOTrainer._write_generations``, which writes them
here too): ``<dir>/<step>.jsonl``, one line per sample with ``input`` and ``output`` (prompt and response decoded
without special tokens), ``gts``, ``score``, ``step`` and one key per reward extra info. The local trainer adds, as
further extra-info keys, ``uid`` (the prompt's group), ``advantage``, ``num_turns``, ``agent_name`` (the agent loop
that rolled the sample out), ``turns`` (``[{"role": "assistant"|"tool", "text"}]``, the response split by verl's
response mask), ``tool_calls`` and ``tool_outputs`` (``[{"text", "error"}]``, plus ``timeout``, ``seconds`` and
``started`` from a loop that records its calls).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
from pathlib import Path

from pipeline_steps.evaluation.markdown import block, cell, fmt
from pipeline_steps.planning.layout import RunLayout

SAMPLES_SHOWN = 3
MAX_TEXT = 1500  # characters of one turn on the page


def write_step(dump_dir, step: int, batch: dict, tokenizer) -> Path:
    """One step's samples with verl's own writer (same file name, keys and encoding as a cluster run)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    inputs = tokenizer.batch_decode(batch["prompts"], skip_special_tokens=True)
    outputs = tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
    scores = batch["token_level_scores"].sum(-1).tolist()
    gts = [item.ground_truth for item in batch["items"]]
    n = len(inputs)
    extra: dict[str, list] = {}
    for key in {k for e in batch["reward_extra"] for k in e}:
        values = [e.get(key) for e in batch["reward_extra"]]
        if all(isinstance(v, (int, float, str, bool)) for v in values):
            extra[key] = values
    # GRPO's outcome advantage is one value per sample, repeated over its tokens: the first response token's
    adv = batch["advantages"][:, 0].tolist()
    extra.update(uid=list(batch["uids"]), advantage=adv, num_turns=[int(t) for t in batch["num_turns"]])
    trajectories = batch.get("trajectories")
    if trajectories:
        for key in ("agent_name", "turns", "tool_calls", "tool_outputs"):
            extra[key] = [t.get(key) for t in trajectories]
    dump = Path(dump_dir)
    # verl's writer announces each file on stdout; a step's stdout is its JSON summary, so the line goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        RayPPOTrainer._write_generations(inputs, outputs, gts, scores, extra, str(dump), step)
    assert all(len(v) == n for v in extra.values())
    return dump / f"{step}.jsonl"


def read(dump_dir) -> tuple[dict[int, list[dict]], int]:
    """``{step: [sample, ...]}`` from ``<step>.jsonl`` files, and the number of unreadable lines skipped."""
    steps: dict[int, list[dict]] = {}
    skipped = 0
    for path in Path(dump_dir).glob("*.jsonl"):
        if not path.stem.isdigit():
            continue
        rows = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                skipped += 1
        steps[int(path.stem)] = rows
    return dict(sorted(steps.items())), skipped


def step_stats(rows: list[dict]) -> dict:
    """Tool-call rate, turns per sample and tool errors of one step's samples."""
    n = len(rows) or 1
    calls = [len(r.get("tool_calls") or []) for r in rows]
    outs = [o for r in rows for o in (r.get("tool_outputs") or []) if isinstance(o, dict)]
    turns = [r["num_turns"] for r in rows if isinstance(r.get("num_turns"), (int, float))]
    scores = [r["score"] for r in rows if isinstance(r.get("score"), (int, float))]
    return {
        "samples": len(rows),
        "tool_call_rate": sum(c > 0 for c in calls) / n,
        "tool_calls": sum(calls),
        "tool_errors": sum(bool(o.get("error")) for o in outs),
        "turns_mean": sum(turns) / len(turns) if turns else math.nan,
        "score_mean": sum(scores) / len(scores) if scores else math.nan,
    }


def _block(text: str) -> list[str]:
    """Model output as a fenced code block (:func:`pipeline_steps.evaluation.markdown.block`), cut at MAX_TEXT
    characters: the page shows it verbatim, so it cannot inject markup."""
    text = str(text)
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + f"\n… ({len(text) - MAX_TEXT} more characters)"
    return block(text)


def render_sample(row: dict) -> list[str]:

    head = (
        f"step {cell(row.get('step'))} · group {cell(row.get('uid', '—'))} · score {fmt(row.get('score'))} · "
        f"advantage {fmt(row.get('advantage'))} · turns {cell(row.get('num_turns', '—'))} · "
        f"ground truth {cell(row.get('gts'))}"
    )
    lines = [f"**{head}**", "", "Prompt:", "", *_block(row.get("input", "")), ""]
    turns = row.get("turns")
    if not isinstance(turns, list):  # a cluster dump without our keys: verl's decoded output
        turns = [{"role": "response", "text": row.get("output", "")}]
    for t in turns:
        if isinstance(t, dict):
            lines += [f"{cell(str(t.get('role', '?')).capitalize())}:", "", *_block(t.get("text", "")), ""]
    for call in row.get("tool_calls") or []:
        lines += ["Tool call:", "", *_block(json.dumps(call, ensure_ascii=False)), ""]
    return lines


def report_section(run_dir: Path, state: dict) -> list[str]:
    """The report's Trajectories section: per-step tool use and a few samples, chosen reproducibly."""
    layout = RunLayout.for_run_dir(str(run_dir))
    dump = Path(layout.rollouts)
    if not dump.is_dir():  # a cluster run without trainer.rollout_data_dir: no section rather than an empty one
        return []
    lines = ["## Trajectories", ""]
    steps, skipped = read(dump)
    state["inputs"][layout.relative(layout.rollouts) + "/"] = f"ok ({len(steps)} steps" + (
        f", {skipped} bad lines skipped)" if skipped else ")"
    )
    if not steps:
        return lines + ["`rollouts/`: no step files.", ""]

    lines += [
        "| step | samples | tool-call rate | tool calls | tool errors | turns / sample | mean score |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for step, rows in steps.items():
        s = step_stats(rows)
        lines.append(
            f"| {step} | {s['samples']} | {fmt(s['tool_call_rate'])} | {s['tool_calls']} | {s['tool_errors']} | "
            f"{fmt(s['turns_mean'])} | {fmt(s['score_mean'])} |"
        )
    lines.append("")
    last = max(steps)
    rows = steps[last]
    # the same samples on every rebuild of the page: seeded by the step
    shown = random.Random(last).sample(rows, min(SAMPLES_SHOWN, len(rows)))
    lines += [f"Samples of step {last}:", ""]
    for row in shown:
        lines += render_sample(row)
    return lines
