"""Fetching from the Hugging Face Hub: snapshots at a pinned revision, and Hub errors as one-line user errors.

Used by the ``download`` step (datasets), the ``stage-model`` step (models) and :mod:`pipeline_steps.data.hub_stream`.
``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` are read at each call, not at ``huggingface_hub`` import.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pipeline_steps import library_env
from pipeline_steps.data import revisions
from pipeline_steps.errors import UserError


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false")


def cache_dir() -> str | None:
    return os.environ.get(library_env.HF_HUB_CACHE) or None  # read now, not at huggingface_hub import


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str, repo_type: str = "dataset", path: str | None = None):
    """Hub errors as one-line user errors naming the repository (and the file, for a single-file download)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    is_offline = offline()
    try:
        yield
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
    except RemoteEntryNotFoundError:  # online: the repository and revision exist, the file does not
        raise UserError(
            f"{repo_type} {repo_id}@{revision} has no file {path!r}; check the path inside the repository"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if is_offline and not revisions.in_cache(repo_id, repo_type):
            raise UserError(
                f"{repo_type} {repo_id} is not in the offline Hub cache (no such repository here); check the name"
            ) from None
        where = "in the offline cache" if is_offline else "locally and the Hub is unreachable"
        what = f"file {path!r} at revision {revision!r}" if path else f"revision {revision!r}"
        raise UserError(
            f"{what} of {repo_type} {repo_id} is not available {where}; "
            "check the name, pin a revision that is cached or allow network access"
        ) from None


def fetch_snapshot(repo_id: str, revision: str, allow_patterns=None, repo_type: str = "dataset") -> Path:
    """``snapshot_download`` with Hub errors turned into one-line user errors."""
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, revision, repo_type):
        return Path(
            snapshot_download(
                repo_id=repo_id,
                repo_type=repo_type,
                revision=revision,
                allow_patterns=list(allow_patterns) or None,
                local_files_only=offline(),  # a pinned commit would otherwise still ask the Hub for its file list
                cache_dir=cache_dir(),
            )
        )
