"""Job status and training progress, the same for both backends: what the triggers report and the XCom holds.

Progress comes from verl's file-logger metrics (:mod:`pipeline_steps.metrics_log`), read by :func:`read_text`: a
local path or a store URI, through a store client handed the store connection's credentials
(:class:`operators.hooks.store_connection.StoreHook`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pipeline_steps import metrics_log
from pipeline_steps.constants import CHECKPOINT_TRACKER

TERMINAL_DEPLOYMENT = ("Complete", "Failed", "ValidationFailed")
PROGRESS_KEYS = ("critic/score/mean", "actor/entropy", "response_length/mean", "perf/throughput", "timing_s/step")


def rayjob_outcome(status: dict | None) -> str:
    """``"running"``, ``"succeeded"`` or ``"failed"`` for a RayJob ``status``.

    :param status: the RayJob's ``.status`` (may be empty right after creation).
    """
    status = status or {}
    deployment, job = status.get("jobDeploymentStatus") or "", status.get("jobStatus") or ""
    if deployment == "Complete" and job == "SUCCEEDED":
        return "succeeded"
    if deployment in TERMINAL_DEPLOYMENT or status.get("reason") in ("DeadlineExceeded", "ValidationFailed"):
        return "failed"
    return "running"


def describe_failure(name: str, status: dict) -> str:
    """One line saying which RayJob failed, how, and why (KubeRay's reason and message)."""
    parts = [
        f"RayJob {name} failed: jobDeploymentStatus={status.get('jobDeploymentStatus') or '-'}",
        f"jobStatus={status.get('jobStatus') or '-'}",
    ]
    if status.get("reason"):
        parts.append(f"reason={status['reason']}")
    if status.get("message"):
        parts.append(f"message={' '.join(str(status['message']).split())[:500]}")
    return ", ".join(parts)


def read_text(uri: str, store_conn_id: str | None = None) -> str | None:
    """The reader of the metrics file, the checkpoint marker and the tracking record: a local path, or a store URI
    (``file://``, ``oss://``, ``gs://``) read through :mod:`pipeline_steps.store`, its client handed the store
    connection's credentials (none: the environment's). ``None`` when it does not exist (yet)."""
    from operators.hooks.store_connection import StoreHook

    return StoreHook(store_conn_id).read_text(uri)


def parse_metrics(text: str | None) -> list[dict]:
    """verl file-logger JSON lines (``{"step": N, "data": {...}}``) -> rows; a torn last line is skipped."""
    return metrics_log.parse(text).rows


def format_progress(row: dict) -> str:
    data = row.get("data") or {}
    shown = " ".join(
        f"{k}={data[k]:.4g}" if isinstance(data[k], float) else f"{k}={data[k]}" for k in PROGRESS_KEYS if k in data
    )
    return f"step {row['step']}: {shown}".rstrip()


def scalar_metrics(row: dict | None) -> dict:
    """The numeric metrics of one step (what goes to XCom)."""
    data = (row or {}).get("data") or {}
    return {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def new_log_lines(previous: Sequence[str], tail: Sequence[str]) -> list[str]:
    """Lines of ``tail`` not shown yet, given the previously shown tail (overlap on its last line)."""
    if previous and previous[-1] in tail:
        idx = len(tail) - 1 - list(reversed(tail)).index(previous[-1])
        return list(tail[idx + 1 :])
    return list(tail)


class ProgressTracker:
    """Reads the metrics file and yields the rows not reported yet (state kept in ``last_step``)."""

    def __init__(self, metrics_uri: str | None, last_step: int = 0, store_conn_id: str | None = None):
        self.metrics_uri, self.last_step = metrics_uri, last_step
        self.store_conn_id = store_conn_id
        self.last_row: dict | None = None
        self.warned = False

    async def poll(self, log) -> None:
        if not self.metrics_uri:
            return
        try:
            text = await asyncio.to_thread(self._read)
        except Exception as exc:  # progress is best effort: never fail the wait on it
            if not self.warned:
                log.warning("cannot read metrics %s (%s); progress not shown", self.metrics_uri, exc)
                self.warned = True
            return
        rows = parse_metrics(text)
        if rows:
            self.last_row = rows[-1]
        for row in rows:
            if row["step"] > self.last_step:
                log.info("progress %s", format_progress(row))
                self.last_step = row["step"]

    def _read(self) -> str | None:
        return read_text(self.metrics_uri, self.store_conn_id)  # a cloud store: the connection's credentials


def checkpoint_step(checkpoint_uri: str | None, store_conn_id: str | None = None) -> int | None:
    """verl's ``latest_checkpointed_iteration.txt`` under the checkpoint dir, if readable."""
    if not checkpoint_uri:
        return None
    try:
        text = read_text(checkpoint_uri.rstrip("/") + "/" + CHECKPOINT_TRACKER, store_conn_id)
        return int(text.strip()) if text and text.strip().isdigit() else None
    except Exception:
        return None
