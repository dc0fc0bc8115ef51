"""Step ``upload``: a local directory -> a manifest-committed version in the store.

``python -m pipeline_steps upload --src DIR --dest URI`` uploads what is missing or
differs (a re-run of a complete version sends zero bytes; an interrupted one is
finished), writes ``_manifest.json`` last, and prints ``uploaded``, ``skipped`` and
``bytes_uploaded``. Credentials come from the environment (see pipeline_steps.store).
"""

from __future__ import annotations

from pipeline_steps import outputs
from pipeline_steps.store import mirror, open_store, parse_uri


def add_arguments(p):
    p.add_argument(
        "--src",
        required=True,
        help="directory to upload (every file below it): a local path, or a store URI (an upstream task's output, "
        "fetched first)",
    )
    p.add_argument(
        "--dest", required=True, help="version URI: file:///abs/path, oss://bucket/prefix or gs://bucket/prefix"
    )


def run(args):
    src = mirror.step_input(args.src, "--src")  # on another machine than the preprocess task: from the store
    if args.dest.startswith("file://"):  # a destination inside the source would upload the store into itself
        outputs.refuse_overlap(parse_uri(args.dest).key, {"--src": src}, what="--dest")
    return open_store(args.dest).upload_dir(src, args.dest)
