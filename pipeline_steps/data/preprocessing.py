"""The preprocess engine: a dataset snapshot turned into verl's row schema, ``DIR/<split>.parquet``, ``stats.json``
and ``rejected.jsonl``.

Splits are resolved from the snapshot's files by ``datasets`` (:mod:`pipeline_steps.data.snapshot_splits`), files are
streamed in record batches through the dataset's registered preprocessor (:mod:`pipeline_steps.data.row_batches`,
:mod:`pipeline_steps.data.preprocessors`), then one shared, vectorised pass removes exact duplicates (same prompt,
same ground truth) and keeps out conflicts (same prompt, different ground truths) (:mod:`pipeline_steps.data.dedupe`).
Output is written atomically and is byte-identical for the same input; an earlier output of the same input and
settings is reused (:func:`existing`). The preprocess step (``pipeline_steps/steps/preprocess.py``) parses its
arguments, moves the input and the output through the store and calls :func:`write_output`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.data import registry
from pipeline_steps.data.dedupe import SplitParts, dedupe, finish_split
from pipeline_steps.data.preprocessors import get_preprocessor
from pipeline_steps.data.rejects import Rejects
from pipeline_steps.data.row_batches import converted_batches
from pipeline_steps.data.snapshot_splits import resolve_splits
from pipeline_steps.digests import sha256_file
from pipeline_steps.errors import UserError

# Bump when a change to the preprocessors changes their output: earlier outputs are then rebuilt, not reused.
PREPROCESSOR_VERSION = 5  # 5: exact dedup keys, JSONL BOM and per-line limits; 4: JSONL rollout_extra is a struct

VARIANTS = ("default", "tool_agent")


def process(spec: registry.DatasetSpec, root: Path, out: Path, variant: str = "default", limit: int | None = None):
    """Write ``out/<split>.parquet`` and ``out/rejected.jsonl`` streaming (memory bounded by a batch, plus 16-byte
    digests per unique row); returns the stats. Raises UserError for unusable input."""
    pre = get_preprocessor(spec.preprocessor)
    data_source = spec.data_source or pre.data_source
    splits = resolve_splits(spec, root)
    if not splits:
        raise UserError(f"--input {root}: no data files found for dataset {spec.name}")
    # a first pass fixing the rows' types over every split (JSONL: rollout_extra's keys), so batches and splits agree
    schema = pre.row_schema([f for fs in splits.values() for f in fs]) if pre.row_schema is not None else None
    stats_splits = {}
    rejects = Rejects(out / "rejected.jsonl")
    try:
        for split, files in sorted(splits.items()):
            out_split = pre.split_names.get(split, split)
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", out_split):
                raise UserError(
                    f"--input {root}: split name {out_split!r} is not a safe file name; rename the data files"
                )
            where = f"dataset {spec.name} split {split}"
            before = len(rejects)
            parts = SplitParts(out, out_split)
            rows_in, converted, unique, conflicts = dedupe(
                converted_batches(pre, files, split, out_split, data_source, rejects, where, schema), parts.write
            )
            rows_out, conflict_rows = finish_split(
                parts, conflicts, limit, variant, pre, rejects, out / f"{out_split}.parquet"
            )
            stats_splits[out_split] = {
                "files": [Path(f).name for f in files],
                "rows_in": rows_in,
                "rows_out": rows_out,
                "duplicates": converted - unique,
                "conflicting_prompts": len(conflicts),
                "conflicting_rows": conflict_rows,
                "rejected": len(rejects) - before,
            }
    finally:
        rejects.close()
    rows_in = sum(s["rows_in"] for s in stats_splits.values())
    if rows_in == 0:
        raise UserError(f"--input {root}: dataset {spec.name} has no rows; check the snapshot and --dataset")
    return {
        "dataset": spec.name,
        "preprocessor": spec.preprocessor,
        "data_source": data_source,
        "variant": variant,
        "limit": limit,
        "splits": stats_splits,
        "rows_in": rows_in,
        "rows_out": sum(s["rows_out"] for s in stats_splits.values()),
        "duplicates": sum(s["duplicates"] for s in stats_splits.values()),
        "conflicting_prompts": sum(s["conflicting_prompts"] for s in stats_splits.values()),
        "rejected": len(rejects),
        "rejected_by_reason": dict(sorted(rejects.by_reason.items())),
    }


def settings_of(
    spec: registry.DatasetSpec, variant: str, limit: int | None, max_rejected_fraction: float, fingerprint: str
) -> dict:
    """Everything that decides a preprocess output: reused only when all of it matches."""
    return {
        "dataset": spec.name,
        "preprocessor": spec.preprocessor,
        "preprocessor_version": PREPROCESSOR_VERSION,
        "variant": variant,
        "limit": limit,
        "max_rejected_fraction": max_rejected_fraction,
        "input_sha256": fingerprint,
    }


def existing(out: Path, settings: dict) -> dict | None:
    """stats.json of a complete earlier run with the same settings and input (the directory appears atomically)."""
    try:
        stats = json.loads((out / "stats.json").read_text())
    except (OSError, ValueError):
        return None
    files_ok = all((out / f"{s}.parquet").is_file() for s, v in stats.get("splits", {}).items() if v.get("rows_out"))
    return stats if stats.get("settings") == settings and files_ok else None


def write_output(
    spec: registry.DatasetSpec,
    root: Path,
    out: Path,
    settings: dict,
    source_uri: str,
    variant: str = "default",
    limit: int | None = None,
    max_rejected_fraction: float = 0.05,
) -> dict:
    """Preprocess ``root`` into ``out`` (replaced atomically) and return the stats written to ``out/stats.json``:
    :func:`process`'s, the content hash of the split files, ``settings`` (what a later run must match to reuse the
    output, :func:`existing`) and the source (``source_uri``, the input as the step was given it, and its commit).

    :raises UserError: one line when more than ``max_rejected_fraction`` of the rows is rejected, when no row is left,
        or for unusable input
    """
    with atomic.atomic_dir(out, owner="preprocess") as tmp:
        stats = process(spec, root, tmp, variant, limit)
        # every row not kept counts, conflicting ground truths included (rows dropped silently were the defect)
        bad = dict(stats["rejected_by_reason"])
        fraction = sum(bad.values()) / stats["rows_in"]
        if fraction > max_rejected_fraction:
            top = ", ".join(f"{r}={n}" for r, n in sorted(bad.items(), key=lambda x: -x[1])[:3])
            raise UserError(
                f"dataset {spec.name}: {sum(bad.values())} of {stats['rows_in']} rows rejected ({fraction:.1%}: "
                f"{top}), above --max-rejected-fraction {max_rejected_fraction}; fix the input or raise the "
                "threshold"
            )
        if not stats["rows_out"]:
            raise UserError(f"dataset {spec.name}: every row was rejected or removed; nothing to write")
        digest = hashlib.sha256()
        for split in sorted(k for k, v in stats["splits"].items() if v["rows_out"]):
            name = f"{split}.parquet"
            digest.update(name.encode() + b"\0" + bytes.fromhex(sha256_file(tmp / name)))
        stats["content_hash"] = digest.hexdigest()
        stats["settings"] = settings  # what a later run must match to reuse this output
        stats["source"] = {
            "input": str(source_uri),
            # a Hub commit, or a JSONL dataset's content revision (download step)
            "commit": root.name if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{16}", root.name) else None,
            **({"files": {"train": spec.train_file, "validation": spec.validation_file}} if spec.train_file else {}),
        }
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True, default=str) + "\n")
    return stats
