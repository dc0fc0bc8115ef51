"""Streamed exact-duplicate removal and conflicts: one shared, vectorised pass over a split's converted batches keeps
each (prompt, ground truth) pair once and keeps out prompts with different ground truths; only 16-byte digests are
held across batches. :func:`finish_split` then writes the split's one parquet file (the variant's shape applied)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline_steps.data.preprocessors import Preprocessor
from pipeline_steps.data.preprocessors.common import framed, ground_truth, prompt_key, tool_agent_rows, unframe_first
from pipeline_steps.data.row_batches import BATCH_ROWS


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def dedupe(tables_in, write):
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


class SplitParts:
    """A split's kept rows as part files below the output's temporary directory (one per batch)."""

    def __init__(self, where: Path, name: str):
        self.where, self.name, self.paths = where, name, []

    def write(self, table) -> None:
        import pyarrow.parquet as pq

        path = self.where / f".part-{self.name}-{len(self.paths):05d}.parquet"
        pq.write_table(table, path, compression="zstd")
        self.paths.append(path)


def finish_split(
    parts: SplitParts, conflicts: set[bytes], limit: int | None, variant: str, pre: Preprocessor, rejects, dest: Path
):
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
            table = pa.Table.from_pylist(tool_agent_rows(table.to_pylist(), pre.tool_name, pre.tool_system_prompt))
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
