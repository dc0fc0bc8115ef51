"""A Hugging Face cache built from fixture files, for machines that cannot reach the Hub.

The real ``snapshot_download`` then runs against it with ``HF_HUB_OFFLINE=1``.
Fixture layout: ``<root>/<org>/<name>/revisions.json`` lists ``{label, date}``
revisions oldest first; ``<root>/<org>/<name>/<label>/`` holds that revision's
files. ``*.jsonl`` files become ``*.parquet`` (what the real repositories hold);
an image ``{"bytes_b64": ...}`` becomes ``{"bytes": ...}``.

Generated repositories (:mod:`pipeline_steps.local.synthetic`) are written the same way (their files as generated:
``pipeline-local/chat-jsonl`` keeps its ``.jsonl`` files).
Each revision gets a deterministic 40-hex commit, a ``refs/<label>`` and the
newest gets ``refs/main``. The commit dates go to ``<cache>/revision-index/``,
which :mod:`pipeline_steps.data.revisions` reads in place of the Hub's commit list.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
from pathlib import Path

from pipeline_steps import atomic


def _to_parquet(jsonl: Path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
    for row in rows:
        for img in row.get("images") or []:
            if "bytes_b64" in img:
                img["bytes"] = base64.b64decode(img.pop("bytes_b64"))
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _revision_files(rev_dir: Path) -> dict[str, bytes]:
    files = {}
    for p in sorted(rev_dir.rglob("*")):
        if p.is_file():
            rel = p.relative_to(rev_dir).as_posix()
            if p.suffix == ".jsonl":
                files[rel[: -len(".jsonl")] + ".parquet"] = _to_parquet(p)
            else:
                files[rel] = p.read_bytes()
    files.setdefault("README.md", b"---\nlicense: mit\n---\nFixture copy for offline tests.\n")
    return files


def commit_for(repo_id: str, label: str, files: dict[str, bytes]) -> str:
    h = hashlib.sha1(f"{repo_id}@{label}".encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


FIXTURES = Path(__file__).with_name("hub")  # package data: the local profile's offline Hub


def build_cache(fixtures_root: str | os.PathLike, cache_dir: str | os.PathLike) -> dict[str, list[dict]]:
    """Write every fixture repository, and the generated synthetic one, into ``cache_dir`` (a ``HF_HUB_CACHE``).

    Idempotent."""
    from pipeline_steps.local import synthetic

    fixtures_root, cache_dir = Path(fixtures_root), Path(cache_dir)
    repos = {}
    for revs_file in sorted(fixtures_root.glob("*/*/revisions.json")):
        repo_dir = revs_file.parent
        repos[repo_dir.relative_to(fixtures_root).as_posix()] = [
            dict(rev, files=_revision_files(repo_dir / rev["label"])) for rev in json.loads(revs_file.read_text())
        ]
    repos[synthetic.REPO_ID] = synthetic.revisions()
    repos[synthetic.JSONL_REPO_ID] = synthetic.jsonl_revisions()  # kept as JSONL: a user's own files
    repos[synthetic.MULTIPLY_REPO_ID] = synthetic.multiply_revisions()  # the tool-learning task
    return {repo_id: _write_repo(cache_dir, repo_id, revs) for repo_id, revs in repos.items()}


def _write_repo(cache_dir: Path, repo_id: str, revisions: list[dict]) -> list[dict]:
    """One dataset repository's revisions (``{label, date, files}``, oldest first) in the Hub cache's layout."""
    repo_cache = cache_dir / ("datasets--" + repo_id.replace("/", "--"))
    index = []
    for rev in revisions:
        files = rev["files"]
        commit = commit_for(repo_id, rev["label"], files)
        for rel, data in files.items():
            blob = repo_cache / "blobs" / hashlib.sha256(data).hexdigest()
            if not blob.exists():
                atomic.write_bytes(blob, data)
            link = repo_cache / "snapshots" / commit / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(blob, link.parent))
        atomic.write_text(repo_cache / "refs" / rev["label"], commit)
        index.append({"commit": commit, "date": rev["date"], "label": rev["label"]})
    atomic.write_text(repo_cache / "refs" / "main", index[-1]["commit"])
    atomic.write_json(cache_dir / "revision-index" / f"{repo_id.replace('/', '--')}.json", index)
    return index
