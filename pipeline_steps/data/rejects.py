"""Rejected rows, streamed to ``rejected.jsonl`` with their split and reason, and counted by reason."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path


class Rejects:
    """Rejected rows, written to ``rejected.jsonl`` as they come: a large bad input is never held in memory."""

    def __init__(self, path: Path):
        self.file = open(path, "w", encoding="utf-8")
        self.by_reason: Counter = Counter()

    def append(self, item) -> None:
        split, row, reason = item
        record = {"split": split, "reason": reason, "row": json_safe(row)}
        self.file.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        self.by_reason[reason] += 1

    def extend(self, items) -> None:
        for item in items:
            self.append(item)

    def __len__(self) -> int:
        return sum(self.by_reason.values())

    def close(self) -> None:
        self.file.close()


def json_safe(obj):
    if isinstance(obj, bytes):
        return f"<{len(obj)} bytes>"
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj
