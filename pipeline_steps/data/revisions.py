"""Resolve a dataset repository's revision as of a date: its newest commit at or before that date.

Scheduled runs and backfills use this so that a run for a logical date trains on the data as it was then.
The commit list comes from a local revision index when one exists (``$PIPELINE_REVISION_INDEX`` or
``$HF_HUB_CACHE/revision-index/<org>--<name>.json``, a list of ``{commit, date}``; the offline fixture cache
writes one) and otherwise from the Hub (``HfApi.list_repo_commits``).
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from pipeline_steps import library_env, settings
from pipeline_steps.errors import UserError

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def parse_date(text: str) -> datetime:
    try:
        d = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UserError(f"--as-of {text!r}: not an ISO-8601 date such as 2026-10-01 or 2026-10-01T00:00:00Z") from None
    return d if d.tzinfo else d.replace(tzinfo=timezone.utc)


def _index_file(repo_id: str) -> Path | None:
    roots = [settings.get(settings.REVISION_INDEX)]
    if os.environ.get(library_env.HF_HUB_CACHE):
        roots.append(str(Path(os.environ[library_env.HF_HUB_CACHE]) / "revision-index"))
    for root in filter(None, roots):
        f = Path(root) / f"{repo_id.replace('/', '--')}.json"
        if f.is_file():
            return f
    return None


def in_cache(repo_id: str, repo_type: str = "dataset") -> bool:
    """Whether the Hugging Face cache holds anything of the repository (offline, the only Hub there is)."""
    from huggingface_hub import constants

    cache = os.environ.get(library_env.HF_HUB_CACHE) or constants.HF_HUB_CACHE
    return (Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}").is_dir()


def commits(repo_id: str) -> tuple[list[dict], str]:
    """[{commit, date}] newest first, and where they came from."""
    f = _index_file(repo_id)
    if f:
        items = json.loads(f.read_text())
        source = "index"
    else:
        import httpx
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
        )

        try:
            # huggingface_hub reads HF_HUB_OFFLINE once, at import: a process that imported it earlier (transformers
            # does) would otherwise try the network although the environment says offline
            if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false"):
                raise OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
            items = [
                {"commit": c.commit_id, "date": c.created_at.isoformat()}
                for c in HfApi().list_repo_commits(repo_id, repo_type="dataset")
            ]
        except RepositoryNotFoundError as exc:
            if isinstance(exc, GatedRepoError):
                raise UserError(
                    f"dataset {repo_id} is gated; accept its terms on the Hub and set a token (HF connection or "
                    "HF_TOKEN)"
                ) from None
            raise UserError(
                f"dataset {repo_id} not found on the Hub (or private without a token); check the name and the HF "
                "connection"
            ) from None
        except OfflineModeIsEnabled:
            if not in_cache(repo_id):
                raise UserError(
                    f"dataset {repo_id} is not in the offline Hub cache (no such repository here); check the name"
                ) from None
            raise UserError(
                f"cannot list commits of {repo_id} offline and no revision index exists; pin the dataset revision"
            ) from None
        except (HfHubHTTPError, httpx.HTTPError, OSError) as exc:  # httpx: no route, DNS, timeout (not OSErrors)
            raise UserError(
                f"cannot list commits of {repo_id} ({exc.__class__.__name__}); "
                "pin the dataset revision or check the HF connection"
            ) from None
        source = "hub"
    return sorted(items, key=lambda c: parse_date(c["date"]), reverse=True), source


def resolve(repo_id: str, as_of: datetime) -> dict:
    history, source = commits(repo_id)
    for c in history:
        if parse_date(c["date"]) <= as_of:
            return {
                "repo_id": repo_id,
                "commit": c["commit"],
                "date": c["date"],
                "as_of": as_of.isoformat(),
                "source": source,
            }
    first = history[-1]["date"] if history else "never"
    raise UserError(
        f"{repo_id} has no commit at or before {as_of.isoformat()} (first commit: {first}); pick a later date or pin a "
        "revision"
    )
