"""The run report's sections, each a list of Markdown lines; ``state`` collects what each input's status was.

Every value read from the run directory goes through :mod:`pipeline_steps.evaluation.markdown` (``cell`` for text,
``code`` for identifiers and answers): a model's answer or a dataset's name never becomes markup on the page.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from pipeline_steps import tracking_run
from pipeline_steps.evaluation import figures
from pipeline_steps.evaluation.markdown import cell, code, fmt, link, safe_url
from pipeline_steps.evaluation.model_card import NR, _get  # one lineage lookup for the card and the report
from pipeline_steps.evaluation.report_charts import CURVES, OPTIONAL_CURVES, TABLE_KEYS, VAL_RE, plot
from pipeline_steps.evaluation.report_inputs import NP, read_json, read_metrics, series
from pipeline_steps.planning.layout import RunLayout

log = logging.getLogger(__name__)

MAX_PROBLEM_ROWS = 60


def _input(run_dir: Path, location: str) -> tuple[Path, str]:
    """A run directory's input (a :class:`RunLayout` property's name) as a local path, and the name the report
    gives it (its path in the run directory)."""
    layout = RunLayout.for_run_dir(str(run_dir))
    where = getattr(layout, location)
    return Path(where), layout.relative(where)


def metrics_section(run_dir: Path, out: Path, state: dict) -> list[str]:
    lines = ["## Training curves", ""]
    path, name = _input(run_dir, "metrics")
    if not path.is_file():
        state["inputs"][name] = NP
        return lines + [f"`metrics.jsonl`: {NP}. No curves.", ""]
    try:
        m = read_metrics(path)
    except OSError as exc:
        state["inputs"][name] = f"unreadable: {exc.__class__.__name__}"
        return lines + [f"`metrics.jsonl`: unreadable ({exc.__class__.__name__}). No curves.", ""]
    steps = m["steps"]
    state["inputs"][name] = "ok"
    state["metrics_steps"] = len(steps)
    state["metrics_skipped_lines"] = len(m["skipped"])
    shown = ", ".join(map(str, m["skipped"][:10])) + (", ..." if len(m["skipped"]) > 10 else "")
    note = f"`metrics.jsonl`: {len(steps)} steps"
    if steps:
        note += f" ({min(steps)}..{max(steps)})"
    if m["skipped"]:
        note += f"; {len(m['skipped'])} malformed line(s) skipped (line {shown})"
    if m["duplicates"]:
        note += f"; {m['duplicates']} repeated step(s), the later line kept"
    lines += [note + ".", ""]
    if m["skipped"]:
        log.warning("metrics.jsonl: %d malformed line(s) skipped (line %s)", len(m["skipped"]), shown)

    val_extra = []
    for key in sorted({k for d in steps.values() for k in d if VAL_RE.match(k)}):
        vx, vy = series(steps, key)
        if vx:
            source = key.split("/", 1)[1].rsplit("/", 1)[0].replace("$", r"\$")  # a data source's $ is not mathtext
            val_extra.append((f"validation {source}", vx, vy, "s"))
    for name, key, title, ylabel in CURVES:
        xs, ys = series(steps, key)
        if not xs:
            lines += [f"**{title}**: {NP} (no `{key}` values in metrics.jsonl).", ""]
            continue
        plot(out / name, xs, ys, title, ylabel, val_extra if key == "critic/score/mean" else None)
        state["plots"].append(name)
        lines += [f"![{title}]({name})", ""]

    for name, key, title, ylabel, companions in OPTIONAL_CURVES:
        xs, ys = series(steps, key)
        if not xs:
            continue
        extra = [(c, *series(steps, c), "-") for c in companions]
        plot(out / name, xs, ys, title, ylabel, [e for e in extra if e[1]] or None)
        state["plots"].append(name)
        lines += [f"![{title}]({name})", ""]

    rows = ["| metric | first | last | min | max | steps |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key in TABLE_KEYS + sorted({k for d in steps.values() for k in d if VAL_RE.match(k)}):
        xs, ys = series(steps, key)
        if xs:
            rows.append(f"| {cell(key)} | {fmt(ys[0])} | {fmt(ys[-1])} | {fmt(min(ys))} | {fmt(max(ys))} | {len(xs)} |")
        else:
            rows.append(f"| {cell(key)} | {NP} | | | | 0 |")
    return lines + rows + [""]


def eval_section(run_dir: Path, state: dict, out: Path | None = None) -> list[str]:
    """The evaluation against the base; with ``out`` (the report directory) the evaluated figures' thumbnails too."""
    from pipeline_steps.evaluation.model_card import _pct, eval_table

    lines = ["## Evaluation against the base model", ""]
    results, results_name = _input(run_dir, "eval_results")
    base_results, base_name = _input(run_dir, "base_results")
    res, status = read_json(results, need=("overall",))
    state["inputs"][results_name] = status
    base, bstatus = read_json(base_results, need=("overall",))
    state["inputs"][base_name] = bstatus
    if res is None:
        return lines + [f"`eval/results.json`: {status}.", ""]
    base_note = "`eval/base_results.json`"
    if base is None and isinstance(res.get("base"), dict) and "overall" in res["base"]:
        base, base_note = res["base"], "the base recorded in `eval/results.json`"  # evaluate embeds it too
    try:
        table = eval_table(res, base)
    except (KeyError, TypeError, ValueError) as exc:
        state["inputs"][results_name] = f"unreadable: overall lacks {exc}"
        return lines + [f"`eval/results.json`: unreadable (its overall section lacks {cell(exc)}).", ""]
    ev, s = res.get("eval_set") or {}, res.get("sampling") or {}
    model = res.get("model") or {}
    lines += [
        f"Evaluation set {code(ev.get('name', NR), table=False)} (sha256 {code(ev.get('sha256', NR), table=False)}); "
        f"k={cell(s.get('k', NR))}, temperature {cell(s.get('temperature', NR))}, top-p {cell(s.get('top_p', NR))}, "
        f"at most {cell(s.get('max_new_tokens', NR))} new tokens.",
        "",
        f"Model {code(model.get('path', NR), table=False)}"
        + (f" (checkpoint step {cell(model['step'])})" if model.get("step") is not None else "")
        + (
            f"; base {code(_get(base, 'model', 'path'), table=False)}"
            if base
            else f"; base: `eval/base_results.json` {bstatus}"
        ),
        "",
        table,
        "",
    ]
    if base is not None:
        lines += [f"Base figures from {base_note}.", ""]
    # pass@j for every j the evaluation reported
    o, bo = res["overall"], (base or {}).get("overall") or {}
    passes = o.get("pass@k") or {}
    if len(passes) > 2:
        lines += ["| pass@j | model | base |", "| --- | ---: | ---: |"]
        for j, v in passes.items():
            b = (bo.get("pass@k") or {}).get(j)
            lines.append(f"| pass@{cell(j)} | {_pct(v)} | {_pct(b)} |")
        lines.append("")
    shown = report_figures(run_dir, out, min(len(res.get("problems") or []), MAX_PROBLEM_ROWS)) if out else {}
    if shown:
        state["figures"] = len(shown)
    lines += problems_table(res, base, shown)
    return lines


def report_figures(run_dir: Path, out: Path, count: int) -> dict[int, str]:
    """The thumbnails the evaluate step wrote (``eval/figures/NNNN.png``) for the first ``count`` problems, re-encoded
    from their pixels into the report directory (:func:`figures.thumbnail`: a file that is not an image, or too big,
    is left out), within ``figures.MAX_REPORT_BYTES`` in all. Returns problem position -> file name in ``out``."""
    src = Path(RunLayout.for_run_dir(str(run_dir)).eval_figures)
    if not src.is_dir():
        return {}
    shown: dict[int, str] = {}
    total = 0
    for i in range(count):
        path = src / figures.name(i)
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > 4 * figures.MAX_BYTES:
                continue
            thumb = figures.thumbnail(path.read_bytes())
        except OSError:
            continue
        if thumb is None:
            continue
        if total + len(thumb) > figures.MAX_REPORT_BYTES:
            break
        name = "figure-" + figures.name(i)  # the report's own name: nothing from the run directory names it
        (out / name).write_bytes(thumb)
        shown[i] = name
        total += len(thumb)
    return shown


def problems_table(res: dict, base: dict | None, shown_figures: dict[int, str] | None = None) -> list[str]:
    """One row per problem: ground truth, the model's and the base's correct samples, the model's majority answer;
    with ``shown_figures`` (position -> thumbnail file in the report directory) the figure beside them, as an image
    whose alt text is fixed (the page inlines it as a ``data:`` URI)."""
    problems = [p for p in res.get("problems") or [] if isinstance(p, dict)]
    if not problems:
        return []
    shown_figures = shown_figures or {}
    base_by_id = {str(p.get("id")): p for p in (base or {}).get("problems") or [] if isinstance(p, dict)}
    up = down = 0
    rows = [
        "| problem | ground truth | model correct/k | base correct/k | majority answer |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    if shown_figures:
        rows = ["| figure " + rows[0], "| --- " + rows[1]]
    for position, p in enumerate(problems):
        b = base_by_id.get(str(p.get("id")))
        if b is not None and isinstance(p.get("correct"), int) and isinstance(b.get("correct"), int):
            up += p["correct"] > b["correct"]
            down += p["correct"] < b["correct"]
        if len(rows) - 2 < MAX_PROBLEM_ROWS:
            base_cell = f"{cell(b.get('correct', '?'))}/{cell(b.get('n', '?'))}" if b else "—"
            maj = code(p["maj_answer"]) if p.get("maj_answer") is not None else "—"
            figure = ""
            if shown_figures:
                name = shown_figures.get(position)
                figure = f"| ![figure]({name}) " if name else "| — "
            rows.append(
                f"{figure}| {cell(p.get('id', '?'))} | {code(p.get('ground_truth', '?'))} | "
                f"{cell(p.get('correct', '?'))}/{cell(p.get('n', '?'))} | {base_cell} | {maj} |"
            )
    head = [f"### Per problem ({len(problems)})", ""]
    if base_by_id:
        head += [f"{up} problem(s) with more correct samples than the base, {down} with fewer.", ""]
    tail = (
        ["", f"({len(problems) - MAX_PROBLEM_ROWS} more in `eval/results.json`.)"]
        if len(problems) > MAX_PROBLEM_ROWS
        else []
    )
    return head + rows + tail + [""]


def lineage_section(run_dir: Path, state: dict) -> list[str]:
    lines = ["## Lineage", ""]
    path, name = _input(run_dir, "lineage")
    lin, status = read_json(path)
    state["inputs"][name] = status
    if lin is None:
        return lines + [f"`lineage.json`: {status}.", ""]
    exp = lin.get("experiment") if isinstance(lin.get("experiment"), dict) else {}
    overrides = exp.get("overrides") if isinstance(exp.get("overrides"), list) else []
    if exp.get("overrides_sha256"):
        ov_hash = exp["overrides_sha256"]
    elif overrides:  # the same digest model_card prints, so the report and the card agree
        ov_hash = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()
    else:
        ov_hash = "none (no overrides)" if "overrides" in exp else NR
    lines += [
        "| | |",
        "| --- | --- |",
        f"| base model | {code(_get(lin, 'base_model', 'name'))} at revision "
        f"{code(_get(lin, 'base_model', 'revision'))} |",
        f"| base model URI | {code(_get(lin, 'base_model', 'uri'))} |",
        f"| experiment preset | {code(exp.get('name') or NR)} (sha256 "
        f"{code(exp.get('preset_sha256') or exp.get('digest') or NR)}) |",
        f"| overrides sha256 | {code(ov_hash)} |",
        f"| verl | {cell(lin.get('verl_version') or NR)} |",
        f"| Airflow DAG / run | {code(lin.get('dag_id') or _get(lin, 'airflow', 'dag_id'))} / "
        f"{code(lin.get('run_id') or _get(lin, 'airflow', 'run_id'))} |",
        f"| run URI | {code(lin.get('run_uri') or NR)} |",
        "",
        "Overrides applied on top of the preset:",
        "",
    ]
    if overrides:
        lines += [f"- {code(o, table=False)}" for o in overrides]
    else:
        lines.append(f"- ({'none' if 'overrides' in exp else NR})")
    lines += [
        "",
        "| dataset | role | source | revision | content hash | URI |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    datasets = [d for d in lin.get("datasets") or [] if isinstance(d, dict)]
    for d in datasets:
        lines.append(
            f"| {cell(_get(d, 'name'))} | {cell(_get(d, 'role'))} | {cell(_get(d, 'repo_id'))} | "
            f"{code(_get(d, 'revision'))} | {code(_get(d, 'content_hash'))} | {code(_get(d, 'uri'))} |"
        )
    if not datasets:
        lines.append(f"| {NR} | | | | | |")
    return lines + [""]


def training_section(run_dir: Path, state: dict, tensorboard: dict | None = None) -> list[str]:
    """The training summary's facts, and where the run is tracked (MLflow run, TensorBoard logs).

    :param tensorboard: ``{uri, command}`` of the event files when the run directory is a fetched copy (a cloud
        store's run); a local run directory is looked at directly.
    """
    lines = ["## Training run", ""]
    path, name = _input(run_dir, "train_summary")
    ts, status = read_json(path)
    state["inputs"][name] = status
    tb_dir = Path(RunLayout.for_run_dir(str(run_dir)).tensorboard)
    if tensorboard is None and tb_dir.is_dir():
        tensorboard = tracking_run.tensorboard_info(str(tb_dir), tb_dir)
    tb_row = f"| TensorBoard logs | {tensorboard_cell(tensorboard or (ts or {}).get('tensorboard'))} |"
    if ts is None:  # a cluster run: no train-local summary, but the entrypoint's MLflow record beside the checkpoints
        recorded = tracking_run.read(_input(run_dir, "mlflow_record")[0])
        rows = ["| | |", "| --- | --- |", f"| MLflow run | {mlflow_cell(recorded)} |", tb_row]
        return lines + [f"`train_summary.json`: {status}.", "", *rows, ""]
    return lines + [
        "| | |",
        "| --- | --- |",
        f"| experiment | {code(ts.get('experiment') or NR)} (digest {code(ts.get('experiment_digest') or NR)}) |",
        f"| last step | {cell(ts.get('last_step', NR))} |",
        f"| resumed from step | {cell(ts.get('resumed_from_step', NR))} |",
        f"| checkpoint | {code(ts.get('checkpoint_dir') or NR)} |",
        f"| metrics file | {code(ts.get('metrics_path') or NR)} |",
        f"| MLflow run | {mlflow_cell(ts.get('mlflow'))} |",
        tb_row,
        "",
    ]


def tensorboard_cell(tb) -> str:
    """Where the event files are and the command that shows them (guide 003's ``trainer.logger`` tensorboard)."""
    if not isinstance(tb, dict) or not tb.get("uri"):
        return "not logged (add tensorboard to trainer.logger)"
    uri = code(str(tb["uri"]))
    return f"{uri}: {code(str(tb['command']))}" if tb.get("command") else uri


def mlflow_cell(run) -> str:
    """The training's MLflow run id, linked to the tracking server when it is a web server."""
    if not isinstance(run, dict) or not run.get("run_id"):
        return "not tracked"
    rid = code(str(run["run_id"]))
    url = safe_url(str(run.get("url") or ""))
    return f"{rid} ({link(url)})" if url else f"{rid} at {code(str(run.get('tracking_uri') or NR))}"


def links_section(dashboard_url: str, exported_uri: str) -> list[str]:
    return [
        "## Links",
        "",
        f"- Ray dashboard: {link(safe_url(dashboard_url)) if dashboard_url else 'not given'}",
        f"- Exported model: {link(safe_url(exported_uri)) if exported_uri else 'not given'}",
        "",
    ]


def tasks_section(states: dict[str, str]) -> list[str]:
    """What ran and what did not, as Airflow saw it when the report started."""
    if not states:
        return []
    lines = ["## Tasks", "", "| task | state |", "| --- | --- |"]
    lines += [f"| {code(task)} | {cell(state or 'not started')} |" for task, state in states.items()]
    return lines + [""]
