"""Download a dataset repository snapshot from the Hugging Face Hub at a pinned revision.

Uses ``huggingface_hub.snapshot_download`` into the Hugging Face cache and then
materialises the snapshot under ``DEST/<name>/<commit>/`` (hard links where the
file system allows), so the output path names the exact commit that was read.
The token comes from ``HF_TOKEN`` (set by the Airflow operator from a connection);
it is read by huggingface_hub itself and never logged.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.data import registry
from pipeline_steps.errors import UserError

log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument(
        "--dataset", required=True, help="dataset name from the registry (gsm8k, dapo_math, geometry3k, aime2024, ...)"
    )
    p.add_argument(
        "--revision", default="main", help="branch, tag or commit to read (pin a commit for reproducible runs)"
    )
    p.add_argument("--dest", required=True, help="directory that receives <dataset>/<commit>/")
    p.add_argument("--registry", default=None, help="YAML/JSON file with extra dataset entries")


def fetch_snapshot(repo_id: str, revision: str, allow_patterns=None, repo_type: str = "dataset") -> Path:
    """``snapshot_download`` with Hub errors turned into one-line user errors."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false")
    try:
        return Path(
            snapshot_download(
                repo_id=repo_id,
                repo_type=repo_type,
                revision=revision,
                allow_patterns=list(allow_patterns) or None,
                local_files_only=offline,  # a pinned commit would otherwise still ask the Hub for its file list
                cache_dir=os.environ.get("HF_HUB_CACHE") or None,  # read now, not at huggingface_hub import
            )
        )
    except RevisionNotFoundError:
        raise UserError(
            f"--revision {revision!r} does not exist in {repo_type} {repo_id}; pass an existing branch, tag or commit"
        ) from None
    except GatedRepoError:
        raise UserError(
            f"{repo_type} {repo_id} is gated; accept its terms on the Hub and set a token (HF connection or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{repo_type} {repo_id} not found (or private without a token); check the name and the HF connection"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        where = "in the offline cache" if offline else "locally and the Hub is unreachable"
        raise UserError(
            f"revision {revision!r} of {repo_type} {repo_id} is not available {where}; "
            "pin a revision that is cached or allow network access"
        ) from None


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


def run(args):
    if not str(args.revision).strip():
        raise UserError("--revision '': empty; pass a branch, tag or 40-hex commit (default main)")
    if Path(args.dest).exists() and not Path(args.dest).is_dir():
        raise UserError(f"--dest {args.dest}: exists and is not a directory; pass a directory for the snapshots")
    spec = registry.get(args.dataset, args.registry)
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
