"""verl's file-logger metrics log: one JSON line per training step, ``{"step": N, "data": {"metric": value, ...}}``.

verl writes it on the cluster (``trainer.logger`` with ``file``, path ``$VERL_FILE_LOGGER_PATH``); the CPU trainer
writes the same lines through verl's own ``FileLogger``. The progress readers (both triggers) and the report read
it here, so a torn last line from a killed writer is skipped the same way everywhere.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

FILE_NAME = "metrics.jsonl"


@dataclass
class MetricsLog:
    """Parsed log: ``rows`` in file order (``{"step", "data"}``), ``skipped`` line numbers that are not logger lines."""

    rows: list[dict] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def by_step(self) -> dict[int, dict]:
        """The last line of each step wins (a resumed attempt re-logs the steps after its checkpoint)."""
        return {r["step"]: r["data"] for r in self.rows}


def _row(line: str) -> dict | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    step, data = obj.get("step"), obj.get("data")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(data, dict):
        return None
    return {"step": step, "data": data}


def parse(text: str | None) -> MetricsLog:
    log = MetricsLog()
    for n, line in enumerate((text or "").splitlines(), 1):
        if not line.strip():
            continue
        row = _row(line)
        if row is None:
            log.skipped.append(n)  # a torn line from a crash, or not a logger line at all
        else:
            log.rows.append(row)
    return log


def read(path: str | os.PathLike) -> MetricsLog:
    """The log at a local path; an absent file is an empty log."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse(f.read())
    except FileNotFoundError:
        return MetricsLog()


def history_through(path: str | os.PathLike, step: int) -> bytes:
    """The log's lines of steps up to ``step`` (what a resumed attempt keeps: later steps run again), as bytes.

    Torn and foreign lines are dropped; an absent file gives ``b""``.
    """
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        return b""
    kept = []
    for line in lines:
        row = _row(line.decode("utf-8", errors="replace"))
        if row is not None and row["step"] <= step:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    return b"".join(kept)
