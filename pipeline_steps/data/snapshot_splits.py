"""A dataset snapshot's splits and fingerprint: which data files make each split (as ``datasets`` resolves them from
the repository's file names, the store's bookkeeping left out) and a sha256 over the input's files."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline_steps.data import registry
from pipeline_steps.digests import sha256_file
from pipeline_steps.errors import UserError
from pipeline_steps.store.claim import CLAIM
from pipeline_steps.store.manifest import MANIFEST, MIRROR_MARKER

BOOKKEEPING = {MANIFEST, MIRROR_MARKER, CLAIM}  # a store version's (or its local copy's) own files, beside the data


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


def input_fingerprint(root: Path) -> str:
    """sha256 over the input's files (names and each file's sha256): a changed or appended file changes it."""
    h = hashlib.sha256()
    # a fetched copy's bookkeeping (its manifest, the mirror's marker) is not the input
    skip = {MANIFEST, MIRROR_MARKER}
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.name not in skip)
    for f in files:
        h.update(str(f.relative_to(root) if f != root else f.name).encode() + b"\0" + sha256_file(f).encode() + b"\0")
    return h.hexdigest()
