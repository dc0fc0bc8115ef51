"""Step ``report``: one page per run, with the training curves, the evaluation against the base and the lineage.

``python -m pipeline_steps report --run-dir DIR [--output DIR] [--dashboard-url URL] [--exported-uri URI]``

Inputs, read from the run directory (a local path or a ``file://`` URI), each optional: a missing one is
shown as "not produced", an unreadable one as "unreadable" with the reason; neither stops the report.

* ``metrics.jsonl``: verl's ``FileLogger`` lines, ``{"step": N, "data": {"critic/score/mean": x, ...}}``
  (the same shape from the cluster's verl and from :mod:`pipeline_steps.local.grpo_cpu`). A line that is not such
  an object is skipped and counted; when a step appears twice (a resumed run) the later line wins.
* ``eval/results.json`` and ``eval/base_results.json`` (:mod:`pipeline_steps.steps.evaluate`).
* ``lineage.json`` (shape at the top of :mod:`pipeline_steps.evaluation.model_card`).
* ``train_summary.json`` (:mod:`pipeline_steps.steps.train_local`); without it (a cluster run) the MLflow run's
  record ``checkpoints/mlflow_run.json`` (:mod:`pipeline_steps.training.verl_main`).
* ``tensorboard/``: where verl's tensorboard logger wrote (the report names it and the command to view it).

Output (one atomic directory, default ``<run-dir>/report/``): ``report.md``, one PNG per curve made with
matplotlib's Agg canvas, and ``report.html`` (the same Markdown rendered by markdown-it-py with raw HTML
disabled, images inlined) when markdown-it-py is installed. The page holds no timestamp, so a retry writes
the same bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pipeline_steps import atomic, metrics_log, outputs, tracking_run
from pipeline_steps.errors import UserError
from pipeline_steps.evaluation import trajectories
from pipeline_steps.evaluation.markdown import cell, fmt
from pipeline_steps.evaluation.model_card import NR, _get  # one lineage lookup for the card and the report
from pipeline_steps.uris import local_path

log = logging.getLogger(__name__)

NP = "not produced"

# (file name, metric key, title, y label); the order is the order on the page
CURVES = (
    ("reward.png", "critic/score/mean", "Reward (critic/score/mean)", "mean score"),
    ("entropy.png", "actor/entropy", "Policy entropy (actor/entropy)", "entropy"),
    ("response_length.png", "response_length/mean", "Response length (response_length/mean)", "tokens"),
    ("throughput.png", "perf/throughput", "Throughput (perf/throughput)", "tokens / s / GPU"),
)
# Plotted only when the metrics carry them (verl logs them on the cluster; the CPU trainer logs all but memory):
# (file name, metric key, title, y label, companion series drawn on the same axes)
OPTIONAL_CURVES = (
    ("grad_norm.png", "actor/grad_norm", "Gradient norm (actor/grad_norm)", "norm", ()),
    ("lr.png", "actor/lr", "Learning rate (actor/lr)", "rate", ()),
    ("mfu.png", "perf/mfu/actor", "Model FLOPs utilisation (perf/mfu/actor)", "fraction of peak", ()),
    (
        "memory.png",
        "perf/max_memory_allocated_gb",
        "Peak memory (perf/max_memory_allocated_gb)",
        "GB",
        ("perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb"),
    ),
    (
        "step_timing.png",
        "timing_s/step",
        "Step time (timing_s/step)",
        "seconds",
        ("timing_s/gen", "timing_s/update_actor", "timing_s/old_log_prob", "timing_s/save_checkpoint"),
    ),
)
TABLE_KEYS = [k for _, k, _, _ in CURVES] + ["timing_s/step"]
# verl's headline validation means, per data source: val-core/<source>/acc/mean@N (the naive reward manager adds acc),
# or .../reward/mean@N when a custom reward reports no acc; the std/best/maj companions stay in the table only
VAL_RE = re.compile(r"^val-core/(.+)/(?:acc|reward)/mean@\d+$")
MAX_PROBLEM_ROWS = 60


def add_arguments(p):
    p.add_argument(
        "--run-dir",
        required=True,
        help="the run directory (local path or file:// URI): metrics.jsonl, eval/, lineage.json",
    )
    p.add_argument("--output", help="report directory (default: <run-dir>/report)")
    p.add_argument("--dashboard-url", default="", help="Ray dashboard URL of the training job (http or https)")
    p.add_argument("--exported-uri", default="", help="URI of the exported model (store URI or URL)")
    p.add_argument(
        "--task-states",
        default="",
        help='JSON {"task": "state", ...}: the run\'s tasks as Airflow saw them (the DAG passes it). With it, a run '
        "directory that was never made (the run stopped before training) is reported, not refused",
    )


# ---------------------------------------------------------------------------------------------
# reading the inputs


def read_metrics(path: Path) -> dict:
    """Metric series from verl's file-logger lines.

    ``{"steps": {step: data}, "skipped": [line numbers], "lines": n, "duplicates": n}``.
    """
    log = metrics_log.read(path)
    steps = log.by_step()  # a resumed run logs the re-run steps again: the later line wins
    return {
        "steps": dict(sorted(steps.items())),
        "skipped": log.skipped,
        "lines": len(log.rows) + len(log.skipped),
        "duplicates": len(log.rows) - len(steps),
    }


def series(steps: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, finite numbers only (orjson writes NaN as null)."""
    xs, ys = [], []
    for step, data in steps.items():
        v = data.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(step)
            ys.append(float(v))
    return xs, ys


def read_json(path: Path, need: tuple[str, ...] = ()) -> tuple[dict | None, str]:
    """(object, status): status is "ok", "not produced" or "unreadable: <why>"."""
    if not path.is_file():
        return None, NP
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return None, f"unreadable: {exc.__class__.__name__}"
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"unreadable: not JSON ({exc.__class__.__name__}: {str(exc).splitlines()[0]})"
    if not isinstance(obj, dict):
        return None, "unreadable: top level is not an object"
    missing = [k for k in need if k not in obj]
    if missing:
        return None, f"unreadable: no {', '.join(missing)}"
    return obj, "ok"


# ---------------------------------------------------------------------------------------------
# Markdown helpers (untrusted text: run ids, overrides typed in the trigger form)


def code(value, table: bool = True) -> str:
    """An inline code span that holds any text (the fence is longer than any backtick run inside).

    In a table cell ``|`` is escaped even inside the span: GFM splits cells before it reads spans.
    """
    s = " ".join(str(value).split()) or " "
    if table:
        s = s.replace("|", "\\|")
    fence = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def safe_url(url: str) -> str:
    """A URL without user:password (a link on the page must not carry credentials)."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return url


def link(url: str) -> str:
    """A Markdown autolink when the URL has no characters that would end it early; else a code span."""
    if url.startswith(("http://", "https://")) and not re.search(r"[\s<>`]", url):
        return f"<{url}>"
    return code(url, table=False)


# ---------------------------------------------------------------------------------------------
# plots


def plot(path: Path, xs: list[int], ys: list[float], title: str, ylabel: str, extra: list | None = None) -> None:
    """One PNG line chart; ``extra`` adds (label, xs, ys, style) series (the validation reward)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label="train")
    for label, ex, ey, style in extra or []:
        ax.plot(ex, ey, style, markersize=6, label=label)
    if extra:
        ax.legend(loc="best", fontsize=8)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})  # no version stamp: same input, same bytes


# ---------------------------------------------------------------------------------------------
# sections


def metrics_section(run_dir: Path, out: Path, state: dict) -> list[str]:
    lines = ["## Training curves", ""]
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        state["inputs"]["metrics.jsonl"] = NP
        return lines + [f"`metrics.jsonl`: {NP}. No curves.", ""]
    try:
        m = read_metrics(path)
    except OSError as exc:
        state["inputs"]["metrics.jsonl"] = f"unreadable: {exc.__class__.__name__}"
        return lines + [f"`metrics.jsonl`: unreadable ({exc.__class__.__name__}). No curves.", ""]
    steps = m["steps"]
    state["inputs"]["metrics.jsonl"] = "ok"
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
            val_extra.append((f"validation {key.split('/', 1)[1].rsplit('/', 1)[0]}", vx, vy, "s"))
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


def eval_section(run_dir: Path, state: dict) -> list[str]:
    from pipeline_steps.evaluation.model_card import _pct, eval_table

    lines = ["## Evaluation against the base model", ""]
    res, status = read_json(run_dir / "eval" / "results.json", need=("overall",))
    state["inputs"]["eval/results.json"] = status
    base, bstatus = read_json(run_dir / "eval" / "base_results.json", need=("overall",))
    state["inputs"]["eval/base_results.json"] = bstatus
    if res is None:
        return lines + [f"`eval/results.json`: {status}.", ""]
    base_note = "`eval/base_results.json`"
    if base is None and isinstance(res.get("base"), dict) and "overall" in res["base"]:
        base, base_note = res["base"], "the base recorded in `eval/results.json`"  # evaluate embeds it too
    try:
        table = eval_table(res, base)
    except (KeyError, TypeError, ValueError) as exc:
        state["inputs"]["eval/results.json"] = f"unreadable: overall lacks {exc}"
        return lines + [f"`eval/results.json`: unreadable (its overall section lacks {cell(exc)}).", ""]
    ev, s = res.get("eval_set") or {}, res.get("sampling") or {}
    model = res.get("model") or {}
    lines += [
        f"Evaluation set {code(ev.get('name', NR), table=False)} (sha256 {code(ev.get('sha256', NR), table=False)}); "
        f"k={s.get('k', NR)}, temperature {s.get('temperature', NR)}, top-p {s.get('top_p', NR)}, "
        f"at most {s.get('max_new_tokens', NR)} new tokens.",
        "",
        f"Model {code(model.get('path', NR), table=False)}"
        + (f" (checkpoint step {model['step']})" if model.get("step") is not None else "")
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
    lines += problems_table(res, base)
    return lines


def problems_table(res: dict, base: dict | None) -> list[str]:
    problems = [p for p in res.get("problems") or [] if isinstance(p, dict)]
    if not problems:
        return []
    base_by_id = {str(p.get("id")): p for p in (base or {}).get("problems") or [] if isinstance(p, dict)}
    up = down = 0
    rows = [
        "| problem | ground truth | model correct/k | base correct/k | majority answer |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for p in problems:
        b = base_by_id.get(str(p.get("id")))
        if b is not None and isinstance(p.get("correct"), int) and isinstance(b.get("correct"), int):
            up += p["correct"] > b["correct"]
            down += p["correct"] < b["correct"]
        if len(rows) - 2 < MAX_PROBLEM_ROWS:
            base_cell = f"{b.get('correct', '?')}/{b.get('n', '?')}" if b else "—"
            maj = code(p["maj_answer"]) if p.get("maj_answer") is not None else "—"
            rows.append(
                f"| {cell(p.get('id', '?'))} | {code(p.get('ground_truth', '?'))} | "
                f"{p.get('correct', '?')}/{p.get('n', '?')} | {base_cell} | {maj} |"
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
    lin, status = read_json(run_dir / "lineage.json")
    state["inputs"]["lineage.json"] = status
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
    ts, status = read_json(run_dir / "train_summary.json")
    state["inputs"]["train_summary.json"] = status
    if tensorboard is None and (run_dir / tracking_run.TENSORBOARD_SUBDIR).is_dir():
        tb_dir = run_dir / tracking_run.TENSORBOARD_SUBDIR
        tensorboard = tracking_run.tensorboard_info(str(tb_dir), tb_dir)
    tb_row = f"| TensorBoard logs | {tensorboard_cell(tensorboard or (ts or {}).get('tensorboard'))} |"
    if ts is None:  # a cluster run: no train-local summary, but the entrypoint's MLflow record beside the checkpoints
        recorded = tracking_run.read(run_dir / "checkpoints" / tracking_run.FILE)
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


def parse_task_states(text: str) -> dict[str, str]:
    if not text:
        return {}
    try:
        states = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--task-states: not JSON ({exc.msg}); pass a JSON object of task id -> state") from None
    if not isinstance(states, dict) or not all(isinstance(k, str) for k in states):
        raise UserError("--task-states: expected a JSON object of task id -> state")
    return {k: "not started" if v is None else str(v) for k, v in states.items()}


def tasks_section(states: dict[str, str]) -> list[str]:
    """What ran and what did not, as Airflow saw it when the report started."""
    if not states:
        return []
    lines = ["## Tasks", "", "| task | state |", "| --- | --- |"]
    lines += [f"| `{cell(task)}` | {cell(state or 'not started')} |" for task, state in states.items()]
    return lines + [""]


def render_html(markdown_text: str, out: Path, title: str) -> str | None:
    """The page as HTML (raw HTML in the Markdown is escaped, not passed through); images inlined."""
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        log.info("markdown-it-py is not installed: report.html skipped (report.md has everything)")
        return None
    import html

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    body = md.render(markdown_text)

    def inline(m):
        p = out / html.unescape(m.group(1))
        if p.is_file() and p.parent == out:
            return 'src="data:image/png;base64,' + base64.b64encode(p.read_bytes()).decode() + '"'
        return m.group(0)

    body = re.sub(r'src="([A-Za-z0-9_.-]+\.png)"', inline, body)
    style = (
        "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2rem .5rem}"
        "code{background:#f4f4f4}img{max-width:100%}"
    )
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>\n{body}</body></html>\n"
    )


# ---------------------------------------------------------------------------------------------


def validate_links(dashboard_url: str, exported_uri: str) -> None:
    if dashboard_url:
        parts = urlsplit(dashboard_url)
        if parts.scheme not in ("http", "https") or not parts.netloc or re.search(r"\s", dashboard_url):
            raise UserError(
                f"--dashboard-url {dashboard_url[:80]!r}: expected an http:// or https:// URL; "
                "pass the Ray dashboard address or leave it out"
            )
    if exported_uri and (re.search(r"[\s\x00-\x1f]", exported_uri) or len(exported_uri) > 2000):
        raise UserError(
            f"--exported-uri {exported_uri[:80]!r}: contains whitespace or control characters (or is too long); "
            "pass the store URI of the exported model"
        )


REMOTE_INPUTS = (
    "metrics.jsonl",
    "lineage.json",
    "train_summary.json",
    f"checkpoints/{tracking_run.FILE}",  # a cluster run's MLflow record (no train_summary.json there)
    "eval/results.json",
    "eval/base_results.json",
)
# verl's rollout dump is one file per step and a big run's steps are tens of MB each: the report fetches the newest
# ones only (its table then starts there; the samples shown are the last step's anyway)
REMOTE_ROLLOUT_STEPS = 20


def run(args) -> dict:
    """On a cloud store (``oss://``, ``gs://``) the run's few small inputs are fetched into a local copy, the report
    is written next to it, and uploaded to ``<run dir>/report/`` as a version; locally it is written in place."""
    if "://" in args.run_dir and not args.run_dir.startswith("file://"):
        return _run_remote(args)
    return _run_local(args)


def _run_remote(args) -> dict:
    import tempfile

    from pipeline_steps.store import open_store

    uri = args.run_dir.rstrip("/")
    store = open_store(uri)
    with tempfile.TemporaryDirectory(prefix="report-") as tmp:
        local = Path(tmp) / "run"
        local.mkdir()
        for rel in REMOTE_INPUTS:  # absent inputs are reported as "not produced", as locally
            data = store.read_bytes(f"{uri}/{rel}")
            if data is not None:
                (local / rel).parent.mkdir(parents=True, exist_ok=True)
                (local / rel).write_bytes(data)
        _fetch_rollouts(store, f"{uri}/rollouts", local / "rollouts")
        tb_uri = tracking_run.tensorboard_dir(uri)
        tb = tracking_run.tensorboard_info(tb_uri) if store.list_names(tb_uri) else None
        out = Path(tmp) / "report"
        summary = _run_local(args, run_dir=local, out=out, shown_dir=uri, tensorboard=tb)
        upload = store.upload_dir(str(out), f"{uri}/report", replace=True)  # regenerated on re-runs
    report_uri = f"{uri}/report"
    summary.update(
        report=f"{report_uri}/report.md",
        html=f"{report_uri}/report.html" if summary.get("html") else None,
        plots=[f"{report_uri}/{Path(x).name}" for x in summary["plots"]],
        uploaded=upload.get("uploaded"),
    )
    return summary


def _fetch_rollouts(store, prefix: str, dest: Path) -> None:
    """The newest ``<step>.jsonl`` files of verl's ``trainer.rollout_data_dir``; none (no directory) when the run
    dumped no rollouts, so the report then has no Trajectories section, as locally."""
    steps = sorted(
        (n for n in store.list_names(prefix) if n.endswith(".jsonl") and n[:-6].isdigit()), key=lambda n: int(n[:-6])
    )
    for name in steps[-REMOTE_ROLLOUT_STEPS:]:
        data = store.read_bytes(f"{prefix}/{name}")
        if data is not None:
            dest.mkdir(exist_ok=True)
            (dest / name).write_bytes(data)


def _run_local(
    args, run_dir: Path | None = None, out: Path | None = None, shown_dir: str | None = None, tensorboard=None
) -> dict:
    run_dir = run_dir or local_path(args.run_dir, "--run-dir")
    task_states = parse_task_states(args.task_states)
    if not run_dir.exists() and task_states:  # the DAG's planned run directory; the run stopped before making it
        run_dir.mkdir(parents=True)
    if not run_dir.is_dir():
        raise UserError(
            f"--run-dir {args.run_dir}: not a directory; pass the run directory that holds metrics.jsonl and eval/"
        )
    out = out or (local_path(args.output, "--output") if args.output else run_dir / "report")
    outputs.refuse_overlap(out, {"--run-dir": run_dir}, allow_inside=True)  # report/ inside the run dir is its place
    validate_links(args.dashboard_url, args.exported_uri)
    lin, _ = read_json(run_dir / "lineage.json")
    title_bits = [str(x) for x in (_get(lin or {}, "experiment", "name", default=None), (lin or {}).get("run_id")) if x]
    title = "Run report" + (": " + " · ".join(title_bits) if title_bits else "")
    state: dict = {"inputs": {}, "plots": [], "metrics_steps": 0, "metrics_skipped_lines": 0}
    with atomic.atomic_dir(out, owner="report") as tmp:
        sections = [f"# {cell(title)}", "", f"Run directory {code(shown_dir or run_dir, table=False)}.", ""]
        sections += tasks_section(task_states)
        sections += metrics_section(run_dir, tmp, state)
        sections += eval_section(run_dir, state)
        sections += trajectories.report_section(run_dir, state)
        sections += lineage_section(run_dir, state)
        sections += training_section(run_dir, state, tensorboard)
        sections += links_section(args.dashboard_url, args.exported_uri)
        sections += ["## Inputs", "", "| file | status |", "| --- | --- |"]
        sections += [f"| `{name}` | {cell(status)} |" for name, status in state["inputs"].items()] + [""]
        text = "\n".join(sections) + "\n"
        atomic.write_text(tmp / "report.md", text)
        page = render_html(text, tmp, title)
        if page is not None:
            atomic.write_text(tmp / "report.html", page)
    report = out / "report.md"
    log.info("run report written to %s", report)
    return {
        "report": str(report),
        "html": str(out / "report.html") if page is not None else None,
        "plots": [str(out / p) for p in state["plots"]],
        "inputs": state["inputs"],
        "metrics_steps": state["metrics_steps"],
        "metrics_skipped_lines": state["metrics_skipped_lines"],
    }
