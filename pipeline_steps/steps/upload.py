"""Step ``upload``: a local directory -> a manifest-committed version in the store.

``python -m pipeline_steps upload --src DIR --dest URI`` uploads what is missing or
differs (a re-run of a complete version sends zero bytes; an interrupted one is
finished), writes ``_manifest.json`` last, and prints ``uploaded``, ``skipped`` and
``bytes_uploaded``. Credentials come from the environment (see pipeline_steps.store).
"""

from __future__ import annotations

from pipeline_steps import outputs
from pipeline_steps.store import open_store, parse_uri


def add_arguments(p):
    p.add_argument("--src", required=True, help="local directory to upload (every file below it)")
    p.add_argument(
        "--dest", required=True, help="version URI: file:///abs/path, oss://bucket/prefix or gs://bucket/prefix"
    )


def run(args):
    if args.dest.startswith("file://"):  # a destination inside the source would upload the store into itself
        outputs.refuse_overlap(parse_uri(args.dest).key, {"--src": args.src}, what="--dest")
    return open_store(args.dest).upload_dir(args.src, args.dest)
