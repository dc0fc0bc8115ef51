"""The exported model's card (README.md): what produced the model, and how it scores against its base.

Lineage comes from the JSON file the DAG passes to ``export --lineage``. Expected shape
(every field optional; a missing one is printed as "not recorded", never guessed)::

    {
      "base_model": {"name": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "<commit>", "uri": "<store uri>"},
      "datasets": [{"name": "gsm8k", "role": "train", "repo_id": "openai/gsm8k",
                    "revision": "<commit>", "content_hash": "<sha256>", "uri": "<store uri>"}],
      "experiment": {"name": "local_tiny", "preset_sha256": "<Experiment.digest()>",
                     "overrides": ["KEY=VALUE", ...], "overrides_sha256": "<sha256>"},
      "verl_version": "0.9.1",
      "dag_id": "verl_grpo_pipeline", "run_id": "manual__...",
      "run_uri": "<store uri of the training run>"
    }

The YAML metadata block is built by huggingface_hub's ``ModelCardData`` so the Hub reads it; it names only values
shaped like Hub repository ids. Every other value from the lineage, the evaluation (ground truths, answers, the
evaluation set's name) or the export record is escaped for where it lands (:mod:`pipeline_steps.evaluation.markdown`),
so the card shows it as typed wherever it is rendered, HTML allowed or not: no image, script, link or heading of its
own. The card's only links are verl's repository and the MLflow run the pipeline recorded (http(s) only).
"""

from __future__ import annotations

import hashlib
import json
import re

from pipeline_steps.evaluation.markdown import cell, code, labelled_link

NR = "not recorded"
# a Hub repository id ("name" or "owner/name"): what the card's metadata may name
HUB_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def _get(d, *path, default=NR):
    for p in path:
        if not isinstance(d, dict) or d.get(p) in (None, ""):
            return default
        d = d[p]
    return d


def _pct(x) -> str:
    return "—" if x is None else f"{100 * float(x):.1f}%"


def _pass_at(overall: dict, k) -> float | None:
    return (overall.get("pass@k") or {}).get(str(k))


def eval_table(results: dict, base: dict | None) -> str:
    """Markdown table: the model, its base and the gain, for avg@k, pass@1, pass@k, maj@k."""
    o = results["overall"]
    b = (base or {}).get("overall") or {}
    k = o["k"]
    rows = [
        ("avg@%d" % k, o["avg@k"], b.get("avg@k")),
        ("pass@1", _pass_at(o, 1), _pass_at(b, 1)),
        ("pass@%d" % k, _pass_at(o, k), _pass_at(b, k)),
        ("maj@%d" % k, o.get("maj@k"), b.get("maj@k")),
    ]
    lines = ["| metric | model | base | gain |", "| --- | ---: | ---: | ---: |"]
    seen = set()
    for name, m, bb in rows:
        if name in seen:  # k == 1: pass@1 and pass@k are the same row
            continue
        seen.add(name)
        gain = "—" if m is None or bb is None else f"{100 * (float(m) - float(bb)):+.1f} pt"
        lines.append(f"| {name} | {_pct(m)} | {_pct(bb)} | {gain} |")
    lines.append(f"\n{cell(o['problems'])} problems, {cell(o['samples_scored'])} samples scored (k={k}).")
    answers = answers_table(results, base)
    return "\n".join(lines) + (f"\n\n{answers}" if answers else "")


def answers_table(results: dict, base: dict | None) -> str:
    """The prior baseline and the answer distributions (model, base, ground truth): what shows a collapse."""
    from pipeline_steps.evaluation.metrics import figures_of

    f = figures_of(results)
    if not f:
        return ""
    b = figures_of(base or {}) or {}
    modal = code(f["modal_ground_truth"])  # answers keep backticks (math_dapo): the span's fence outruns them

    top_m = f"{_pct(f['majority_top_share'])} ({code(f['majority_top'])})" if f.get("majority_top") is not None else "—"
    top_b = f"{_pct(b['majority_top_share'])} ({code(b['majority_top'])})" if b.get("majority_top") is not None else "—"
    return "\n".join(
        [
            f"Best constant answer: {modal} every time scores **{_pct(f['best_constant'])}** "
            f"avg@{results['overall']['k']} (the share of the most common ground truth); "
            "a model that learned only the prior scores about that.",
            "",
            "| answers | model | base | ground truth |",
            "| --- | ---: | ---: | ---: |",
            f"| avg@k on the {cell(f['non_modal_problems'])} problems whose answer is not {modal} | "
            f"{_pct(f.get('non_modal_avg@k'))} | {_pct(b.get('non_modal_avg@k'))} | — |",
            f"| distinct majority answers | {cell(f['majority_distinct'])} | {cell(b.get('majority_distinct', '—'))} | "
            f"{cell(f['ground_truth_distinct'])} |",
            f"| share of the most common majority answer | {top_m} | {top_b} | "
            f"{_pct(f['ground_truth_top_share'])} ({modal}) |",
        ]
    )


def _metadata(lineage: dict) -> str:
    from huggingface_hub import ModelCardData

    def repo_id(x):  # the Hub links these: a value of any other shape is left out of the metadata (it is in the card)
        return x if isinstance(x, str) and HUB_REPO_ID.match(x) and ".." not in x else None

    datasets = [
        repo_id(d.get("repo_id") or d.get("name")) for d in lineage.get("datasets") or [] if isinstance(d, dict)
    ]
    data = ModelCardData(
        library_name="transformers",
        base_model=repo_id(_get(lineage, "base_model", "name", default=None)),
        datasets=[d for d in datasets if d] or None,
        tags=["verl", "grpo", "reinforcement-learning"],
    )
    return data.to_yaml()


def render(record: dict, results: dict, base: dict | None) -> str:
    """README.md text for an export ``record`` (see pipeline_steps.steps.export) and its evaluations."""
    lin = record.get("lineage") or {}
    exp = lin.get("experiment") or {}
    overrides = exp.get("overrides") or []
    ov_hash = exp.get("overrides_sha256") or (
        hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest() if overrides else NR
    )
    verl_version = lin.get("verl_version")
    if not verl_version:
        try:
            from importlib.metadata import version

            verl_version = f"{version('verl')} (exporting environment)"
        except Exception:
            verl_version = NR
    ev = results.get("eval_set") or {}
    sampling = results.get("sampling") or {}
    promo = record.get("promotion") or {}
    ds_rows = ["| dataset | role | source | revision | content hash |", "| --- | --- | --- | --- | --- |"]
    for d in lin.get("datasets") or []:
        ds_rows.append(
            f"| {cell(_get(d, 'name'))} | {cell(_get(d, 'role'))} | {cell(_get(d, 'repo_id'))} | "
            f"{code(_get(d, 'revision'))} | {code(_get(d, 'content_hash'))} |"
        )
    if len(ds_rows) == 2:
        ds_rows.append(f"| {NR} | | | | |")
    ov_lines = [f"- {code(o, table=False)}" for o in overrides] or [f"- ({'none' if 'overrides' in exp else NR})"]
    step = cell(_get(record, "checkpoint", "step"))
    promoted = "promoted to latest" if promo.get("promote") else "candidate"
    return f"""---
{_metadata(lin)}
---

# {cell(record.get("experiment", NR))} · {cell(record.get("version", NR))}

GRPO post-training of {code(_get(lin, "base_model", "name"), table=False)} with [verl](https://github.com/volcengine/verl),
merged from the FSDP checkpoint of training step {step} with verl's model merger.

## Evaluation

Evaluation set {code(ev.get("name", NR), table=False)} (sha256 {code(ev.get("sha256", NR), table=False)}), \
k={cell(sampling.get("k", NR))} samples per problem, temperature {cell(sampling.get("temperature", NR))}, \
top-p {cell(sampling.get("top_p", NR))}, at most {cell(sampling.get("max_new_tokens", NR))} new tokens;
answers scored by verl's own reward code ({code(results.get("scorer", NR), table=False)}).

{eval_table(results, base)}

Promotion at export time: **{promoted}** — {cell(promo.get("reason", NR))}.

## Lineage

| | |
| --- | --- |
| base model | {code(_get(lin, "base_model", "name"))} at revision {code(_get(lin, "base_model", "revision"))} |
| experiment preset | {code(exp.get("name", NR))} (sha256 {code(exp.get("preset_sha256") or exp.get("digest") or NR)}) |
| overrides sha256 | {code(ov_hash)} |
| verl | {cell(verl_version)} |
| Airflow DAG / run | {code(lin.get("dag_id") or _get(lin, "airflow", "dag_id"))} / \
{code(lin.get("run_id") or _get(lin, "airflow", "run_id"))} |
| training run | {code(lin.get("run_uri", NR))} |
| MLflow run | {_mlflow_cell(record.get("mlflow"))} |
| checkpoint | {code(_get(record, "checkpoint", "dir"))} step {step} |
| weights sha256 | {code(record.get("weights_sha256", NR))} |
| exported at | {code(record.get("exported_at", NR))} |

Overrides applied on top of the preset:

{chr(10).join(ov_lines)}

{chr(10).join(ds_rows)}

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("PATH_TO_THIS_DIRECTORY")
tokenizer = AutoTokenizer.from_pretrained("PATH_TO_THIS_DIRECTORY")
```
"""


def _mlflow_cell(run: dict | None) -> str:
    """The MLflow run id, linked when the recorded URL is an http(s) one (the tracking server's web UI);
    "not tracked" without a run."""
    if not run or not run.get("run_id"):
        return "not tracked"
    rid = code(run["run_id"])
    if run.get("url"):
        return labelled_link(rid, str(run["url"]))
    return f"{rid} at {code(run.get('tracking_uri', NR))}"
