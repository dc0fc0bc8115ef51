"""Turn a dataset snapshot into verl's row schema: ``DIR/<split>.parquet``, ``stats.json``, ``rejected.jsonl``.

The step parses its arguments, fetches the input from the store and commits the output back to it; the engine
(splits, streamed conversion by the dataset's registered preprocessor, dedupe and conflicts, the atomic output) is
:mod:`pipeline_steps.data.preprocessing`. Its summary is one line of JSON that the plan's upload request reads.
"""

from __future__ import annotations

import argparse
import logging

from pipeline_steps import outputs
from pipeline_steps.data import preprocessing, registry
from pipeline_steps.data.snapshot_splits import input_fingerprint
from pipeline_steps.errors import UserError
from pipeline_steps.store import mirror

log = logging.getLogger(__name__)
VARIANTS = preprocessing.VARIANTS


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


def run(args):
    spec = registry.for_step(args)
    # tasks share nothing but the store: the snapshot comes from it (a store URI, fetched into the local mirror),
    # and the output goes back to it (written locally, then committed) for the upload task on another machine
    root = mirror.step_input(args.input, "--input")
    out = mirror.step_output(args.output)
    outputs.refuse_overlap(out, {"--input": root})
    settings = preprocessing.settings_of(
        spec, args.variant, args.limit, args.max_rejected_fraction, input_fingerprint(root)
    )
    if mirror.is_remote(args.output) and args.skip_existing:
        mirror.fetch(args.output)  # an earlier attempt's committed output, on any machine, is reused
    if args.skip_existing and (stats := preprocessing.existing(out, settings)):
        log.info("dataset %s: %s already holds this input's output; skipping", spec.name, args.output)
        mirror.publish_output(args.output)  # a no-op when committed; finishes an attempt killed before its commit
        return _summary(spec, args.output, stats, skipped=True)
    if not 0.0 <= args.max_rejected_fraction <= 1.0:
        raise UserError(f"--max-rejected-fraction {args.max_rejected_fraction}: must be between 0 and 1")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: must be at least 1")
    stats = preprocessing.write_output(
        spec, root, out, settings, args.input, args.variant, args.limit, args.max_rejected_fraction
    )
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
