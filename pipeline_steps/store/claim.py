"""One content per version: the claim that makes concurrent uploads to one version safe.

Before an upload writes any object of a version it creates ``<version>/_claim.json`` with the store's conditional
create (exclusive link on file://, ``x-oss-forbid-overwrite`` on OSS, ``if_generation_match=0`` on GCS), naming the
sha256 of the manifest it will commit. Of writers racing for a version, the one whose create succeeds owns it; a
writer of the same content goes on (it writes the same bytes and the same manifest); a writer of other content is
refused before it writes an object, so it never overwrites the owner's objects.

The claim stays with the committed version (``delete_prefix`` removes it last). A writer that fails before its
commit withdraws its own claim, so a corrected source can be uploaded; a killed writer's claim keeps refusing other
content (not the same content, which resumes) until the version is deleted: no timeout guesses whether it is dead.
"""

from __future__ import annotations

import json
import uuid

from pipeline_steps.errors import TransientError, UserError

CLAIM = "_claim.json"


def _held(store, key: str) -> dict | None:
    raw = store._get_bytes(key)
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return {}  # unreadable: someone else's, not ours


def other_content(uri: str, why: str) -> UserError:
    return UserError(
        f"{uri}: {why}; a version holds one content: upload to a new version name, or delete {uri} first if no "
        "upload of it is running"
    )


def take(store, version_key: str, digest: str, uri: str) -> str | None:
    """Claim the version for the content whose manifest has sha256 ``digest``.

    :returns: our token when this call created the claim (ours to withdraw), None when the claim already names the
        same content. UserError when it names other content.
    """
    key = store._join(version_key, CLAIM)
    token = uuid.uuid4().hex
    body = (json.dumps({"manifest_sha256": digest, "writer": token}, sort_keys=True) + "\n").encode()
    for _ in range(5):  # a claim withdrawn between our create and our read: create again
        if store._create_bytes(key, body):
            return token
        held = _held(store, key)
        if held is None:
            continue
        if held.get("manifest_sha256") == digest:
            return None
        raise other_content(uri, "another upload of different content holds it (or was interrupted)")
    raise TransientError(f"{uri}: its upload claim kept changing hands; retried")


def withdraw(store, version_key: str, token: str | None) -> None:
    """Remove the claim if this writer created it (a failed upload gives the version back)."""
    if token is None:
        return
    key = store._join(version_key, CLAIM)
    if (_held(store, key) or {}).get("writer") == token:
        store._delete([key])
