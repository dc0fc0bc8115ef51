"""A split's files as batches of verl rows: each file read in record batches (parquet) or line chunks (a
preprocessor's own ``read_rows``), each batch converted by the dataset's preprocessor; rejected rows are handed to
``rejects`` as they come."""

from __future__ import annotations

from pathlib import Path

from pipeline_steps.data.preprocessors import Preprocessor
from pipeline_steps.data.preprocessors.common import Reject
from pipeline_steps.errors import UserError

BATCH_ROWS = 65536
LINE_BATCH_ROWS = 4096  # JSONL rows are Python dicts until converted: smaller batches bound memory


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


def converted_batches(pre: Preprocessor, files, split, out_split, data_source, rejects, where, schema=None):
    """Yield (rows_in, pa.Table of verl rows) per batch; rejected rows go to ``rejects``. ``schema``: the rows' types
    fixed up front (the preprocessor's ``row_schema``), else inferred per batch."""
    import pyarrow as pa

    start = 0
    for path in files:
        if pre.read_rows is not None:  # line-oriented formats (JSONL)
            source = _chunks(pre.read_rows(path), rejects, out_split)
        else:
            source = (
                b.to_pylist() if pre.convert_row is not None else b
                for b in _parquet_batches(path, pre.required_columns, where)
            )
        for batch in source:
            try:
                if pre.convert_batch is not None:
                    table, bad = pre.convert_batch(batch, out_split, start, data_source)
                    n_in = batch.num_rows
                    rejects.extend((out_split, r, reason) for r, reason in bad)
                else:
                    rows, n_in = [], len(batch)
                    for i, row in enumerate(batch):
                        try:
                            rows.append(pre.convert_row(row, out_split, start + i, data_source))
                        except Reject as r:
                            rejects.append((out_split, row, str(r)))
                    table = pa.Table.from_pylist(rows, schema=schema) if rows else None
            except (AttributeError, TypeError, KeyError, ValueError, pa.ArrowException) as exc:
                raise UserError(
                    f"{where}: {Path(path).name} does not have the columns the {pre.name} "
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
