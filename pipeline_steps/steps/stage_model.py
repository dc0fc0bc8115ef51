"""Step ``stage-model``: model weights at a pinned revision -> ``<root>/models/<org>/<name>/<revision>/``.

SOURCE is one of
- a Hugging Face repo id (``org/name``): streamed file by file at ``--revision`` (data/hub_stream.py; token from
  ``HF_TOKEN``, read by huggingface_hub itself); the path names the resolved commit; offline, a cached snapshot;
- a local directory: staged under ``models/local/<dir name>/<revision>``;
- ``tiny``: the project's tiny Qwen2-architecture model, built locally
  (pipeline_steps.local.tiny_model) under ``models/local/tiny/<revision>``; ``tiny-tool``: the same made able to
  call the code tool (pipeline_steps.local.tiny_tool_model), under ``models/local/tiny-tool/<revision>``; ``tiny-vl``:
  the tiny vision-language model (Qwen2.5-VL architecture with its processor; pipeline_steps.local.tiny_vl_model),
  under ``models/local/tiny-vl/<revision>``.
For local sources the revision defaults to a short hash of the files' content, so
the same weights always land in the same place. A version that is already staged
and verifies against its manifest is skipped (for a pinned Hub commit, without
contacting the Hub).
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
from pathlib import Path

from pipeline_steps import settings
from pipeline_steps.errors import UserError
from pipeline_steps.store import open_store, parse_uri
from pipeline_steps.store.checksums import _ChecksumCache, file_checksums
from pipeline_steps.store.local_files import _source_files

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REV_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
LOCAL_BUILDS = ("tiny", "tiny-tool", "tiny-vl")  # models built on this machine (pipeline_steps/local/)


def add_arguments(p):
    p.add_argument(
        "--model",
        required=True,
        help="Hub repo id (org/name), a local directory, or a local build: 'tiny', 'tiny-tool', 'tiny-vl'",
    )
    p.add_argument(
        "--hub-only",
        action="store_true",
        help="accept only a Hub repo id or 'tiny', never a local directory (the DAG passes it: the name is untrusted)",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="Hub branch/tag/commit (pin a commit); for local sources a label (default: content hash)",
    )
    p.add_argument(
        "--dest", required=True, help="store root URI; the model goes to <dest>/models/<org>/<name>/<revision>/"
    )


def content_revision(src: Path, length: int = 12) -> str:
    """Short hash of a directory's file names and contents (stable across machines)."""
    cache = _ChecksumCache()
    h = hashlib.sha256()
    for rel, path in _source_files(src):
        h.update(f"{rel}\0{file_checksums(path, None, cache)['sha256']}\n".encode())
    return h.hexdigest()[:length]


def _check_revision(rev: str) -> str:
    if not REV_RE.match(rev or ""):
        raise UserError(f"--revision {rev!r}: use a commit hash, tag or branch of letters, digits, '.', '_' or '-'")
    return rev


def _already_staged(store, uri: str, local: Path | None) -> bool:
    manifest, problems = store.verify(uri)
    if manifest is None:
        return False
    if problems:
        log.warning("staged model %s does not verify (%s); re-staging", uri, "; ".join(problems[:3]))
        return False
    if local is not None:  # same files as the source? A committed version is never replaced by other content
        cache = _ChecksumCache()
        want = {rel: file_checksums(p, None, cache)["sha256"] for rel, p in _source_files(local)}
        have = {e["path"]: e["sha256"] for e in manifest["files"]}
        if want != have:
            raise UserError(
                f"{uri} already holds a different model under that name and revision; stage this one under "
                "another --revision (or rename its directory)"
            )
    return True


def _skipped(store, uri: str, revision: str, source: str = "tiny") -> dict:
    manifest = store.read_manifest(uri)
    log.info("model %s already staged at %s", source, uri)
    return {
        "uri": uri,
        "revision": revision,
        "source": source,
        "skipped": True,
        "uploaded": 0,
        "files": len(manifest["files"]),
        "bytes_uploaded": 0,
    }


def _stage(store, src: Path, uri: str, revision: str, source: str) -> dict:
    if _already_staged(store, uri, src):
        return _skipped(store, uri, revision, source)
    summary = store.upload_dir(src, uri)
    return {**summary, "uri": uri, "revision": revision, "source": source, "skipped": False}


def run(args):
    root = parse_uri(args.dest)
    store = open_store(args.dest)
    model = args.model.strip()
    if model in LOCAL_BUILDS:  # tiny-tool: the tiny model made able to call the code tool; tiny-vl: reads images
        from pipeline_steps.local import tiny_model, tiny_tool_model, tiny_vl_model

        if args.revision:  # a named revision already staged is that model: no rebuild (the build trains a warm-up)
            uri = str(root.child(f"models/local/{model}/{_check_revision(args.revision)}"))
            if _already_staged(store, uri, None):
                return _skipped(store, uri, args.revision, model)
        builder = {"tiny": tiny_model, "tiny-tool": tiny_tool_model, "tiny-vl": tiny_vl_model}[model]
        with tempfile.TemporaryDirectory(prefix="tiny-model-") as tmp:
            src = builder.build_cached(settings.cache_dir(), Path(tmp))
            rev = _check_revision(args.revision) if args.revision else content_revision(src)
            return _stage(store, src, str(root.child(f"models/local/{model}/{rev}")), rev, model)
    local = Path(model).expanduser()
    if args.hub_only and not REPO_RE.match(model):
        raise UserError(f"--model {model!r}: expected a Hub repo id of the form org/name (or tiny)")
    if local.is_dir() and not args.hub_only:  # --hub-only: a name from the trigger form never reads worker files
        name = local.resolve().name
        if not NAME_RE.match(name):
            raise UserError(
                f"--model {model!r}: directory name {name!r} cannot be used as a model name; rename it (letters, "
                "digits, '.', '_', '-')"
            )
        rev = _check_revision(args.revision) if args.revision else content_revision(local)
        return _stage(store, local, str(root.child(f"models/local/{name}/{rev}")), rev, str(local))
    if not REPO_RE.match(model):
        raise UserError(f"--model {model!r}: not a directory, not 'tiny', and not a Hub repo id of the form org/name")
    org, name = model.split("/")
    revision = _check_revision(args.revision or "main")
    if COMMIT_RE.match(revision):  # pinned: check the store before touching the Hub
        uri = str(root.child(f"models/{org}/{name}/{revision}"))
        if _already_staged(store, uri, None):
            manifest = store.read_manifest(uri)
            return {
                "uri": uri,
                "revision": revision,
                "source": model,
                "skipped": True,
                "uploaded": 0,
                "files": len(manifest["files"]),
                "bytes_uploaded": 0,
            }
    from pipeline_steps.data.hub import fetch_snapshot, offline

    if not offline():
        # Streamed by default: the worker pod has no disk sized for a model (a 32B one is ~65 GB); one file at a time
        # needs only the largest file. For a small model a snapshot would be no cheaper: the same bytes cross once.
        from pipeline_steps.data import hub_stream

        commit, files = hub_stream.hub_files(model, revision)
        uri = str(root.child(f"models/{org}/{name}/{commit}"))
        if _already_staged(store, uri, None):
            return _skipped(store, uri, commit, model)
        scratch = Path(tempfile.gettempdir())
        hub_stream.check_disk(scratch, files, model)
        summary = hub_stream.stage(store, model, commit, files, uri, str(scratch))
        return {**summary, "uri": uri, "revision": commit, "source": model, "skipped": False}
    # offline: the snapshot comes from the local Hub cache (already on this disk)
    snapshot = fetch_snapshot(model, revision, (), repo_type="model")
    commit = snapshot.name  # snapshot folders are named by the resolved commit
    return _stage(store, snapshot, str(root.child(f"models/{org}/{name}/{commit}")), commit, model)
