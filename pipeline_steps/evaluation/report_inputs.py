"""The run report's inputs: verl's metric lines, the run directory's JSON records, the DAG's task states.

A missing input is "not produced", an unreadable one "unreadable: <why>"; neither stops the report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline_steps import metrics_log
from pipeline_steps.errors import UserError

NP = "not produced"


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
