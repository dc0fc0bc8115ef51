"""Download a dataset repository snapshot from the Hugging Face Hub at a pinned revision.

Uses ``huggingface_hub.snapshot_download`` into the Hugging Face cache and then
materialises the snapshot under ``DEST/<name>/<commit>/`` (hard links where the
file system allows), so the output path names the exact commit that was read.
The token comes from ``HF_TOKEN`` (set by the Airflow operator from a connection);
it is read by huggingface_hub itself and never logged.

A dataset of JSONL files named by URI (``--train-file``/``--validation-file``, or a registry entry's
``train_file``/``validation_file``) is materialised the same way as ``DEST/<name>/<revision>/train.jsonl`` (and
``validation.jsonl``): a Hub file (``hf://datasets/...``) through ``hf_hub_download`` at its commit (the revision),
a store file (``file://``, ``oss://``, ``gs://``) through the store layer, its revision then the first 16 hex digits
of the sha256 of the files' bytes: the same bytes give the same version, changed bytes a new one.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from pipeline_steps import atomic
from pipeline_steps.data import hub, registry
from pipeline_steps.data.hub import fetch_snapshot
from pipeline_steps.digests import sha256_file
from pipeline_steps.errors import UserError

log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument(
        "--dataset",
        default=None,
        help="dataset name from the registry (gsm8k, dapo_math, geometry3k, aime2024, ...); with --train-file, the "
        "name to give the JSONL dataset (default: derived from the file)",
    )
    p.add_argument(
        "--train-file",
        default=None,
        help="a JSONL file instead of a registry repository: file:///abs/x.jsonl, oss://bucket/key.jsonl, "
        "gs://bucket/key.jsonl or hf://datasets/<org>/<name>[@<revision>]/<path>.jsonl",
    )
    p.add_argument("--validation-file", default=None, help="with --train-file: a JSONL file for the validation split")
    p.add_argument(
        "--revision", default="main", help="branch, tag or commit to read (pin a commit for reproducible runs)"
    )
    p.add_argument("--dest", required=True, help="directory that receives <dataset>/<commit>/ (a local cache)")
    p.add_argument(
        "--store-dest",
        default=None,
        help="store URI under which the snapshot is also committed, as <dataset>/<commit>/ (the dataset version's "
        "raw lineage, and what the preprocess task reads on another machine); the summary's path is then that URI",
    )
    p.add_argument("--registry", default=None, help="YAML/JSON file with extra dataset entries")


def fetch_hub_file(uri: str, what: str) -> tuple[Path, str, str]:
    """One dataset file named ``hf://datasets/<org>/<name>[@<revision>]/<path>`` through ``hf_hub_download`` into the
    Hugging Face cache: (its path in the cache, the commit it was read at, the repository id)."""
    from huggingface_hub import hf_hub_download

    parsed = registry.hub_file(uri, what)
    revision = parsed.revision or "main"
    try:
        with hub.hub_errors(parsed.id, revision, path=parsed.path_in_repo):
            path = Path(
                hf_hub_download(
                    parsed.id,
                    parsed.path_in_repo,
                    repo_type="dataset",
                    revision=revision,
                    local_files_only=hub.offline(),
                    cache_dir=hub.cache_dir(),
                )
            )
    except UserError as exc:
        raise UserError(f"{what} {uri}: {exc}") from None
    # the cache's layout: <repo>/snapshots/<commit>/<path in repo>
    commit = path.parts[-len(PurePosixPath(parsed.path_in_repo).parts) - 1]
    return path, commit, parsed.id


def materialise(snapshot: Path, dest: Path, allow_patterns=()) -> int:
    """Copy (hard-link when possible) a snapshot's files into ``dest`` atomically; skip when present.

    Files outside ``allow_patterns`` are left out (an offline cache may hold more than was asked for).
    """
    if (dest / ".complete").exists():
        return 0
    n = 0
    with atomic.atomic_dir(dest, owner="download", what="--dest") as tmp:
        for src in sorted(snapshot.rglob("*")):
            rel = src.relative_to(snapshot).as_posix()
            if src.is_dir() or (allow_patterns and not any(fnmatch.fnmatch(rel, pat) for pat in allow_patterns)):
                continue
            out = tmp / src.relative_to(snapshot)
            out.parent.mkdir(parents=True, exist_ok=True)
            real = src.resolve()
            try:
                os.link(real, out)
            except OSError:
                shutil.copyfile(real, out)
            n += 1
        (tmp / ".complete").write_text("")
    return n


STAGING = ".tmp-incoming."


def download_files(spec: registry.DatasetSpec, dest: Path) -> dict:
    """A JSONL dataset (``spec.train_file`` and optional ``spec.validation_file``) -> ``dest/<name>/<revision>/
    {train,validation}.jsonl``. Revision: the Hub commit when every file is a Hub file of one repository read at one
    commit, otherwise the first 16 hex digits of the sha256 over the files (split name and content)."""
    from pipeline_steps.store import open_store

    files = {"train": spec.train_file}
    if spec.validation_file:
        files["validation"] = spec.validation_file
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--dest {dest}: cannot write there ({exc.strerror}); choose a writable directory") from None
    for stale in dest.glob(f"{STAGING}*"):  # a killed run's staging directory
        if atomic.abandoned(stale, STAGING):
            shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING}{os.getpid()}.", dir=dest))
    try:
        sources, commits = {}, set()
        for split, uri in files.items():
            what = "--train-file" if split == "train" else "--validation-file"
            target = staging / f"{split}.jsonl"
            if uri.startswith("hf://"):
                path, commit, repo_id = fetch_hub_file(uri, what)
                try:
                    os.link(path.resolve(), target)
                except OSError:
                    shutil.copyfile(path.resolve(), target)
                commits.add((repo_id, commit))
                sources[split] = {"uri": uri, "repo_id": repo_id, "commit": commit}
            else:
                registry.check_file_uri(uri, what)
                open_store(uri).download_file(uri, target, what)
                sources[split] = {"uri": uri}
            sources[split].update(sha256=sha256_file(target), bytes=target.stat().st_size)
        if len(commits) == 1 and all("commit" in s for s in sources.values()):
            (repo_id, revision), kind = next(iter(commits)), "hub-commit"
        else:
            h = hashlib.sha256()
            for split in sorted(sources):
                h.update(f"{split}\0{sources[split]['sha256']}\0".encode())
            repo_id, revision, kind = "", h.hexdigest()[:16], "content-sha256"
        out = dest / spec.name / revision
        n = materialise(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    names = sorted(f"{split}.jsonl" for split in files)
    log.info("dataset %s: %s -> %s (%s %s, %d new files)", spec.name, files, out, kind, revision, n)
    return {
        "dataset": spec.name,
        "repo_id": repo_id,
        "revision": revision,
        "revision_kind": kind,
        "commit": revision,  # the version's folder name, as for a Hub snapshot
        "path": str(out),
        "files": names,
        "sources": sources,
    }


def run(args):
    summary = _download(args)
    if args.store_dest:  # tasks share nothing but the store: the snapshot is handed over there
        from pipeline_steps.store import open_store

        uri = f"{args.store_dest.rstrip('/')}/{summary['dataset']}/{summary['commit']}"
        committed = open_store(uri).upload_dir(summary["path"], uri)
        log.info("snapshot committed to %s (%d files sent, %d there)", uri, committed["uploaded"], committed["skipped"])
        summary.update(path=uri, snapshot_uri=uri)
    return summary


def _download(args):
    if Path(args.dest).exists() and not Path(args.dest).is_dir():
        raise UserError(f"--dest {args.dest}: exists and is not a directory; pass a directory for the snapshots")
    spec = registry.for_step(args)
    if spec.train_file:
        if args.revision != "main":
            raise UserError(
                f"--revision {args.revision!r}: a JSONL file's version is its Hub revision in the URI "
                "(hf://datasets/<org>/<name>@<revision>/<path>.jsonl) or, for a store file, its content; "
                "drop --revision"
            )
        return download_files(spec, Path(args.dest))
    if not spec.repo_id:
        raise UserError(
            f"--dataset {spec.name!r} names no Hub repository and no JSONL file; pass --train-file with a JSONL URI"
        )
    if not str(args.revision).strip():
        raise UserError("--revision '': empty; pass a branch, tag or 40-hex commit (default main)")
    snapshot = fetch_snapshot(spec.repo_id, args.revision, spec.allow_patterns)
    commit = snapshot.name  # snapshot folders are named by the resolved commit
    out = Path(args.dest) / spec.name / commit
    n = materialise(snapshot, out, spec.allow_patterns)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != ".complete")
    if not any(f.endswith((".parquet", ".jsonl", ".json", ".csv", ".arrow")) for f in files):
        raise UserError(
            f"dataset {spec.name} ({spec.repo_id}@{commit[:12]}) has no data files matching "
            f"{list(spec.allow_patterns)}; check the registry entry"
        )
    log.info("dataset %s: %s@%s -> %s (%d files, %d new)", spec.name, spec.repo_id, commit, out, len(files), n)
    return {
        "dataset": spec.name,
        "repo_id": spec.repo_id,
        "revision": args.revision,
        "commit": commit,
        "path": str(out),
        "files": files,
    }
