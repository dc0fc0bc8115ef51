"""Turn a dataset snapshot into verl's row schema: ``DIR/<split>.parquet``, ``stats.json``, ``rejected.jsonl``.

Splits are resolved from the snapshot's files by ``datasets`` (its data-files patterns), files are streamed in
record batches, rows go through the dataset's preprocessor (``pipeline_steps.data.preprocessors.<name>``), then one
shared, vectorised pass removes exact duplicates (same prompt, same ground truth) and keeps out conflicts (same
prompt, different ground truths). Output is written atomically and is byte-identical for the same input.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import re
from collections import Counter
from pathlib import Path

from pipeline_steps import atomic, outputs
from pipeline_steps.data import registry
from pipeline_steps.data.preprocessors.common import (
    Reject,
    framed,
    ground_truth,
    prompt_key,
    tool_agent_rows,
    unframe_first,
)
from pipeline_steps.errors import UserError
from pipeline_steps.store import mirror
from pipeline_steps.store.claim import CLAIM
from pipeline_steps.store.manifest import MANIFEST, MIRROR_MARKER

# Bump when a change to the preprocessors changes their output: earlier outputs are then rebuilt, not reused.
PREPROCESSOR_VERSION = 5  # 5: exact dedup keys, JSONL BOM and per-line limits; 4: JSONL rollout_extra is a struct

log = logging.getLogger(__name__)
BOOKKEEPING = {MANIFEST, MIRROR_MARKER, CLAIM}  # a store version's (or its local copy's) own files, beside the data
BATCH_ROWS = 65536
LINE_BATCH_ROWS = 4096  # JSONL rows are Python dicts until converted: smaller batches bound memory
VARIANTS = ("default", "tool_agent")


def add_arguments(p):
    p.add_argument(
        "--dataset",
        default=None,
        help="dataset name from the registry (gsm8k, dapo_math, geometry3k, aime2024, jsonl, ...); with --train-file, "
        "the JSONL dataset's name",
    )
    p.add_argument(
        "--train-file",
        default=None,
        help="the JSONL file URI the download step read (a dataset named by its files rather than the registry)",
    )
    p.add_argument("--validation-file", default=None, help="with --train-file: the validation JSONL file URI")
    p.add_argument("--input", required=True, help="snapshot directory (from the download step) or a JSONL file")
    p.add_argument("--output", required=True, help="output directory (replaced atomically)")
    p.add_argument(
        "--variant", default="default", choices=VARIANTS, help="tool_agent: rows for verl's multi-turn tool recipes"
    )
    p.add_argument(
        "--max-rejected-fraction",
        type=float,
        default=0.05,
        help="fail when more than this fraction of rows is rejected (default 0.05)",
    )
    p.add_argument("--limit", type=int, default=None, help="keep at most this many rows per split (smoke runs)")
    p.add_argument("--registry", default=None, help="YAML/JSON file with extra dataset entries")
    p.add_argument(
        "--skip-existing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip when OUTPUT already holds a complete result for the same input and settings (default on)",
    )


def resolve_splits(spec: registry.DatasetSpec, root: Path) -> dict[str, list[str]]:
    """split -> data files, as ``datasets`` resolves them from the repository's file names."""
    if root.is_file():
        return {"train": [str(root)]}
    if not root.is_dir():
        raise UserError(f"--input {root}: no such file or directory; pass the snapshot path from the download step")
    import tempfile

    import datasets

    # the store's bookkeeping beside a version's files is not data (its two JSON files outvote a lone parquet file
    # in datasets' choice of format): datasets sees the snapshot without it, as a tree of real directories and links
    # to each other file (datasets' file search does not descend into a linked directory)
    entries = list(root.iterdir())
    kept = [p for p in entries if p.name not in BOOKKEEPING]
    with tempfile.TemporaryDirectory(prefix="snapshot-view-") as view:
        base = root if len(kept) == len(entries) else Path(view)
        if base != root:
            for top in kept:
                for p in [top, *sorted(top.rglob("*"))] if top.is_dir() else [top]:
                    target = base / p.relative_to(root)
                    if p.is_dir():
                        target.mkdir(parents=True, exist_ok=True)
                    else:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.symlink_to(p.resolve())
        try:
            builder = datasets.load_dataset_builder(str(base), data_dir=spec.config)
        except (FileNotFoundError, ValueError, datasets.exceptions.DataFilesNotFoundError) as exc:
            raise UserError(
                f"--input {root}: no data files for dataset {spec.name} ({' '.join(str(exc).split())[:160]})"
            ) from None
        files = builder.config.data_files or {}

    def under_root(f) -> str:  # a file seen through a link, named in the snapshot (a followed link: as resolved)
        p = Path(str(f))
        return str(root / p.relative_to(base)) if p.is_relative_to(base) else str(p)

    return {str(split): sorted(under_root(f) for f in paths) for split, paths in files.items()}


def _parquet_batches(path: str, required: tuple[str, ...], where: str):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        raise UserError(
            f"{where}: {Path(path).name} is not a readable parquet file ({exc.__class__.__name__}); re-download the "
            "snapshot"
        ) from None
    names = set(pf.schema_arrow.names)
    missing = [c for c in required if c not in names]
    if missing:
        raise UserError(f"{where}: missing columns {missing} (found {sorted(names)}); is this the right --dataset?")
    yield from pf.iter_batches(batch_size=BATCH_ROWS)


def _columns(path) -> str:
    """``name: type`` of a parquet file's columns (for an error message)."""
    try:
        import pyarrow.parquet as pq

        return ", ".join(f"{f.name}: {f.type}" for f in pq.read_schema(path))
    except Exception:
        return "schema unreadable"


def _converted_batches(module, files, split, out_split, data_source, rejects, where, schema=None):
    """Yield (rows_in, pa.Table of verl rows) per batch; rejected rows go to ``rejects``. ``schema``: the rows' types
    fixed up front (the preprocessor's ``row_schema``), else inferred per batch."""
    import pyarrow as pa

    start = 0
    for path in files:
        if hasattr(module, "read_rows"):  # line-oriented formats (JSONL)
            source = _chunks(module.read_rows(path), rejects, out_split)
        else:
            source = (
                b.to_pylist() if hasattr(module, "convert_row") else b
                for b in _parquet_batches(path, module.REQUIRED_COLUMNS, where)
            )
        for batch in source:
            try:
                if hasattr(module, "convert_batch"):
                    table, bad = module.convert_batch(batch, out_split, start, data_source)
                    n_in = batch.num_rows
                    rejects.extend((out_split, r, reason) for r, reason in bad)
                else:
                    rows, n_in = [], len(batch)
                    for i, row in enumerate(batch):
                        try:
                            rows.append(module.convert_row(row, out_split, start + i, data_source))
                        except Reject as r:
                            rejects.append((out_split, row, str(r)))
                    table = pa.Table.from_pylist(rows, schema=schema) if rows else None
            except (AttributeError, TypeError, KeyError, ValueError, pa.ArrowException) as exc:
                raise UserError(
                    f"{where}: {Path(path).name} does not have the columns the {module.__name__.rsplit('.', 1)[-1]} "
                    f"preprocessor reads ({_columns(path)}; {exc.__class__.__name__}: {exc}); is this the right "
                    "--dataset?"
                ) from None
            start += n_in
            yield n_in, table


def _chunks(rows_and_reasons, rejects, split):
    chunk = []
    for row, reason in rows_and_reasons:
        if reason:
            rejects.append((split, row, reason))
            chunk.append(None)  # still counts as a row read
        else:
            chunk.append(row)
        if len(chunk) >= LINE_BATCH_ROWS:
            yield _Chunk(chunk)
            chunk = []
    if chunk:
        yield _Chunk(chunk)


class _Chunk(list):
    """A batch of rows where ``None`` marks a line already rejected while reading."""

    def __iter__(self):
        return (r for r in list.__iter__(self) if r is not None)

    def __len__(self):
        return list.__len__(self)


class _Rejects:
    """Rejected rows, written to ``rejected.jsonl`` as they come: a large bad input is never held in memory."""

    def __init__(self, path: Path):
        self.file = open(path, "w", encoding="utf-8")
        self.by_reason: Counter = Counter()

    def append(self, item) -> None:
        split, row, reason = item
        record = {"split": split, "reason": reason, "row": _json_safe(row)}
        self.file.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        self.by_reason[reason] += 1

    def extend(self, items) -> None:
        for item in items:
            self.append(item)

    def __len__(self) -> int:
        return sum(self.by_reason.values())

    def close(self) -> None:
        self.file.close()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _dedupe(tables_in, write):
    """Streamed exact-duplicate removal: each batch's first occurrences go to ``write(table)`` with a ``_key``
    column (the prompt's 16-byte digest). Only digests are kept across batches, never prompts, so memory grows by
    ~100 bytes per unique row. Returns (rows seen, rows converted, rows kept, digests of conflicting prompts)."""
    import numpy as np
    import pyarrow as pa

    seen: set[bytes] = set()  # (prompt, ground truth) pairs kept so far
    truth_of: dict[bytes, bytes] = {}  # prompt -> the first ground truth seen for it
    conflicts: set[bytes] = set()
    rows_in = converted = unique = 0
    for n_in, t in tables_in:
        rows_in += n_in
        if t is None or len(t) == 0:
            continue
        converted += len(t)
        key = prompt_key(t["prompt"])
        if "_key_extra" in t.column_names:
            key = framed(key, t["_key_extra"])
            t = t.drop_columns(["_key_extra"])
        # framed (length-prefixed), never joined with a separator: exact for any bytes in a prompt or an answer
        pair = framed(key, ground_truth(t)).dictionary_encode()
        uniq, first = np.unique(pair.indices.to_numpy(zero_copy_only=False), return_index=True)
        values = pair.dictionary.to_pylist()
        keep = []
        for u, f in zip(uniq.tolist(), first.tolist()):
            v = values[u]
            d = _digest(v)
            if d in seen:
                continue
            seen.add(d)
            k, g = unframe_first(v)
            kd, gd = _digest(k), _digest(g)
            if truth_of.setdefault(kd, gd) != gd:
                conflicts.add(kd)
            keep.append((f, kd))
        keep.sort()
        if keep:
            rows = pa.array([f for f, _ in keep], pa.int64())
            write(t.take(rows).append_column("_key", pa.array([kd for _, kd in keep], pa.binary(16))))
            unique += len(keep)
        del values, pair
    return rows_in, converted, unique, conflicts


class _Parts:
    """A split's kept rows as part files below the output's temporary directory (one per batch)."""

    def __init__(self, where: Path, name: str):
        self.where, self.name, self.paths = where, name, []

    def write(self, table) -> None:
        import pyarrow.parquet as pq

        path = self.where / f".part-{self.name}-{len(self.paths):05d}.parquet"
        pq.write_table(table, path, compression="zstd")
        self.paths.append(path)


def _finish_split(parts: _Parts, conflicts: set[bytes], limit: int | None, variant: str, module, rejects, dest: Path):
    """Conflicting prompts out, ``limit`` applied, the variant's shape, then one parquet file in one schema
    (batches may infer different types: they are unified as ``concat_tables`` would). Returns (rows, conflict rows).
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    value_set = pa.array(sorted(conflicts), pa.binary(16))
    shaped, rows, conflict_rows = [], 0, 0
    for i, path in enumerate(parts.paths):
        table = pq.read_table(path)
        path.unlink()
        if conflicts:
            is_conflict = pc.is_in(table["_key"], value_set=value_set)
            for row in table.filter(is_conflict).drop_columns(["_key"]).to_pylist():
                rejects.append((parts.name, row, "conflicting_ground_truth"))
            conflict_rows += pc.sum(is_conflict).as_py() or 0
            table = table.filter(pc.invert(is_conflict))
        table = table.drop_columns(["_key"])
        if limit is not None:
            table = table.slice(0, max(0, limit - rows))
        if variant == "tool_agent" and len(table):
            table = pa.Table.from_pylist(
                tool_agent_rows(table.to_pylist(), module.TOOL_NAME, getattr(module, "TOOL_SYSTEM_PROMPT", None))
            )
        if len(table):
            out = parts.where / f".shaped-{parts.name}-{i:05d}.parquet"
            pq.write_table(table, out, compression="zstd")
            shaped.append(out)
            rows += len(table)
    if not shaped:
        return 0, conflict_rows
    schema = pa.unify_schemas([pq.read_schema(p) for p in shaped], promote_options="permissive")
    empty = schema.empty_table()
    with pq.ParquetWriter(dest, schema, compression="zstd") as writer:
        for path in shaped:
            table = pa.concat_tables([empty, pq.read_table(path)], promote_options="permissive")
            writer.write_table(table, row_group_size=BATCH_ROWS)
            path.unlink()
    return rows, conflict_rows


def _json_safe(obj):
    if isinstance(obj, bytes):
        return f"<{len(obj)} bytes>"
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def process(spec: registry.DatasetSpec, root: Path, out: Path, variant: str = "default", limit: int | None = None):
    """Write ``out/<split>.parquet`` and ``out/rejected.jsonl`` streaming (memory bounded by a batch, plus 16-byte
    digests per unique row); returns the stats. Raises UserError for unusable input."""
    module = importlib.import_module(f"pipeline_steps.data.preprocessors.{spec.preprocessor}")
    data_source = spec.data_source or module.DATA_SOURCE
    splits = resolve_splits(spec, root)
    if not splits:
        raise UserError(f"--input {root}: no data files found for dataset {spec.name}")
    # a first pass fixing the rows' types over every split (JSONL: rollout_extra's keys), so batches and splits agree
    schema = module.row_schema([f for fs in splits.values() for f in fs]) if hasattr(module, "row_schema") else None
    stats_splits = {}
    rejects = _Rejects(out / "rejected.jsonl")
    try:
        for split, files in sorted(splits.items()):
            out_split = getattr(module, "SPLIT_NAMES", {}).get(split, split)
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", out_split):
                raise UserError(
                    f"--input {root}: split name {out_split!r} is not a safe file name; rename the data files"
                )
            where = f"dataset {spec.name} split {split}"
            before = len(rejects)
            parts = _Parts(out, out_split)
            rows_in, converted, unique, conflicts = _dedupe(
                _converted_batches(module, files, split, out_split, data_source, rejects, where, schema), parts.write
            )
            rows_out, conflict_rows = _finish_split(
                parts, conflicts, limit, variant, module, rejects, out / f"{out_split}.parquet"
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


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _summary(spec, out: str, stats: dict, skipped: bool) -> dict:
    """The step's summary; ``out`` is the output as given (a store URI is what the upload task is handed)."""
    splits = sorted(k for k, v in stats["splits"].items() if v["rows_out"])
    out = str(out).rstrip("/")
    return {
        "dataset": spec.name,
        "output": out,
        "splits": {s: f"{out}/{s}.parquet" for s in splits},
        "content_hash": stats["content_hash"],
        "rows_out": stats["rows_out"],
        "duplicates": stats["duplicates"],
        "rejected": stats["rejected"],
        "commit": stats["source"]["commit"],
        "skipped": skipped,
    }


def input_fingerprint(root: Path) -> str:
    """sha256 over the input's files (names, sizes and content): a changed or appended file changes it."""
    h = hashlib.sha256()
    # a fetched copy's bookkeeping (its manifest, the mirror's marker) is not the input
    skip = {MANIFEST, MIRROR_MARKER}
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.name not in skip)
    for f in files:
        h.update(str(f.relative_to(root) if f != root else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def settings_of(spec, args, fingerprint: str) -> dict:
    """Everything that decides a preprocess output: reused only when all of it matches."""
    return {
        "dataset": spec.name,
        "preprocessor": spec.preprocessor,
        "preprocessor_version": PREPROCESSOR_VERSION,
        "variant": args.variant,
        "limit": args.limit,
        "max_rejected_fraction": args.max_rejected_fraction,
        "input_sha256": fingerprint,
    }


def _existing(out: Path, settings: dict) -> dict | None:
    """stats.json of a complete earlier run with the same settings and input (the directory appears atomically)."""
    try:
        stats = json.loads((out / "stats.json").read_text())
    except (OSError, ValueError):
        return None
    files_ok = all((out / f"{s}.parquet").is_file() for s, v in stats.get("splits", {}).items() if v.get("rows_out"))
    return stats if stats.get("settings") == settings and files_ok else None


def run(args):
    spec = registry.for_step(args)
    # tasks share nothing but the store: the snapshot comes from it (a store URI, fetched into the local mirror),
    # and the output goes back to it (written locally, then committed) for the upload task on another machine
    root = mirror.step_input(args.input, "--input")
    out = mirror.step_output(args.output)
    outputs.refuse_overlap(out, {"--input": root})
    settings = settings_of(spec, args, input_fingerprint(root))
    if mirror.is_remote(args.output) and args.skip_existing:
        mirror.fetch(args.output)  # an earlier attempt's committed output, on any machine, is reused
    if args.skip_existing and (stats := _existing(out, settings)):
        log.info("dataset %s: %s already holds this input's output; skipping", spec.name, args.output)
        mirror.publish_output(args.output)  # a no-op when committed; finishes an attempt killed before its commit
        return _summary(spec, args.output, stats, skipped=True)
    if not 0.0 <= args.max_rejected_fraction <= 1.0:
        raise UserError(f"--max-rejected-fraction {args.max_rejected_fraction}: must be between 0 and 1")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: must be at least 1")
    with atomic.atomic_dir(out, owner="preprocess") as tmp:
        stats = process(spec, root, tmp, args.variant, args.limit)
        # every row not kept counts, conflicting ground truths included (rows dropped silently were the defect)
        bad = dict(stats["rejected_by_reason"])
        fraction = sum(bad.values()) / stats["rows_in"]
        if fraction > args.max_rejected_fraction:
            top = ", ".join(f"{r}={n}" for r, n in sorted(bad.items(), key=lambda x: -x[1])[:3])
            raise UserError(
                f"dataset {spec.name}: {sum(bad.values())} of {stats['rows_in']} rows rejected ({fraction:.1%}: "
                f"{top}), above --max-rejected-fraction {args.max_rejected_fraction}; fix the input or raise the "
                "threshold"
            )
        if not stats["rows_out"]:
            raise UserError(f"dataset {spec.name}: every row was rejected or removed; nothing to write")
        digest = hashlib.sha256()
        for split in sorted(k for k, v in stats["splits"].items() if v["rows_out"]):
            name = f"{split}.parquet"
            digest.update(name.encode() + b"\0" + bytes.fromhex(_file_sha256(tmp / name)))
        stats["content_hash"] = digest.hexdigest()
        stats["settings"] = settings  # what a later run must match to reuse this output
        stats["source"] = {
            "input": str(args.input),
            # a Hub commit, or a JSONL dataset's content revision (download step)
            "commit": root.name if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{16}", root.name) else None,
            **({"files": {"train": spec.train_file, "validation": spec.validation_file}} if spec.train_file else {}),
        }
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True, default=str) + "\n")
    log.info(
        "dataset %s: %d rows in, %d out, %d duplicates, %d rejected -> %s",
        spec.name,
        stats["rows_in"],
        stats["rows_out"],
        stats["duplicates"],
        stats["rejected"],
        args.output,
    )
    mirror.publish_output(args.output)
    return _summary(spec, args.output, stats, skipped=False)
