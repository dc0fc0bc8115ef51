"""Where the object store appears inside the cluster's pods.

On Kubernetes the buckets (OSS through the ossfs CSI driver, GCS through the GCS
Fuse CSI driver) are PersistentVolumeClaims mounted into the Ray pods, so a store
URI such as ``gs://bucket/datasets/gsm8k/...`` is read by verl as
``/mnt/store/datasets/gsm8k/...``. A :class:`MountMap` holds that mapping, built
from config (a preset's ``cluster.mounts``) or from ``$PIPELINE_MOUNTS`` (JSON)::

    [{"uri": "gs://my-bucket", "claim": "verl-store", "path": "/mnt/store"}]
    {"gs://my-bucket": {"claim": "verl-store", "path": "/mnt/store", "readOnly": false}}

Optional per entry: ``readOnly`` (bool), ``subPath`` (folder of the volume to mount),
``podAnnotations`` (what the CSI driver needs on the pods, e.g. GCS Fuse's
``{"gke-gcsfuse/volumes": "true"}``).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re

from pipeline_steps import settings
from pipeline_steps.errors import UserError

ENV_VAR = settings.MOUNTS
URI_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<rest>.*)$")
# PVC names are DNS-1123 subdomains; volume names DNS-1123 labels.
CLAIM_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
RESERVED_PATHS = ("/dev/shm",)


def split_uri(uri: str) -> tuple[str, str] | None:
    """``scheme://rest`` -> (scheme, rest), or None for a plain path."""
    m = URI_RE.match(str(uri))
    return (m.group("scheme"), m.group("rest")) if m else None


def _clean_rel(rel: str, what: str) -> str:
    """Normalise the part of a URI below a mount; refuse anything that climbs out of it."""
    rel = rel.strip("/")
    if not rel:
        return ""
    norm = posixpath.normpath(rel)
    if norm == ".." or norm.startswith("../") or "\x00" in rel or "\n" in rel:
        raise UserError(f"{what}: path climbs out of its mount; use a URI without '..' segments")
    return "" if norm == "." else norm


@dataclasses.dataclass(frozen=True)
class Mount:
    uri: str  # scheme://bucket[/prefix], no trailing slash
    claim: str  # PersistentVolumeClaim name
    path: str  # mount path inside the pods
    read_only: bool = False
    sub_path: str | None = None
    pod_annotations: tuple[tuple[str, str], ...] = ()

    @property
    def volume(self) -> str:
        """Pod volume name: a DNS-1123 label derived from the claim (and subPath)."""
        base = re.sub(r"[^a-z0-9-]", "-", self.claim)[:50].strip("-") or "store"
        return base if not self.sub_path else f"{base[:40]}-{_short_hash(self.sub_path)}"


def _short_hash(s: str) -> str:
    import hashlib

    return hashlib.sha256(s.encode()).hexdigest()[:8]


class MountMap:
    """Store URI prefixes -> PVC mounts in the Ray pods (longest prefix wins)."""

    def __init__(self, mounts: list[Mount] | tuple[Mount, ...] = ()):
        self.mounts = tuple(sorted(mounts, key=lambda m: len(m.uri), reverse=True))
        seen: dict[str, Mount] = {}
        paths: dict[str, Mount] = {}
        for m in self.mounts:
            if m.uri in seen:
                raise UserError(f"mounts: {m.uri!r} is listed twice; keep one entry per URI prefix")
            if m.path in paths:
                raise UserError(
                    f"mounts: {m.uri!r} and {paths[m.path].uri!r} use the same path {m.path!r}; give each its own path"
                )
            seen[m.uri] = paths[m.path] = m

    def __len__(self) -> int:
        return len(self.mounts)

    def __repr__(self) -> str:
        return f"MountMap({[dataclasses.asdict(m) for m in self.mounts]})"

    @classmethod
    def from_config(cls, config: dict | list | None, *, source: str = "mounts") -> "MountMap":
        if config is None or config == [] or config == {}:
            return cls()
        if isinstance(config, dict):
            entries = []
            for uri, entry in config.items():
                if not isinstance(entry, dict):
                    raise UserError(f"{source}: entry for {uri!r} must be a mapping with claim and path")
                entries.append({"uri": uri, **entry})
        elif isinstance(config, list):
            entries = config
        else:
            raise UserError(
                f"{source}: expected a list of {{uri, claim, path}} entries or a mapping of URI to {{claim, path}}"
            )
        return cls([_parse_entry(e, source) for e in entries])

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "MountMap":
        raw = (settings.get(ENV_VAR, environ) or "").strip()
        if not raw:
            return cls()
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"${ENV_VAR}: not valid JSON ({exc.msg} at char {exc.pos}); "
                "expected a list of {uri, claim, path} entries, as in docs/cluster.md"
            ) from None
        return cls.from_config(config, source=f"${ENV_VAR}")

    @classmethod
    def for_experiment(cls, spec: dict) -> "MountMap":
        """The pods' bucket mounts for a run: the deployment's ``$PIPELINE_MOUNTS`` when set, else the preset's
        ``cluster.mounts``. Every reader of mounts (plan, train, the cluster steps, render-rayjob) asks here."""
        env = cls.from_env()
        if len(env):
            return env
        return cls.from_config((spec.get("cluster") or {}).get("mounts"), source="cluster.mounts")

    def find(self, uri: str) -> tuple[Mount, str] | None:
        """The mount holding ``uri`` and the path below it, or None."""
        uri = str(uri)
        for m in self.mounts:  # longest prefix first
            if uri == m.uri or uri.startswith(m.uri + "/"):
                return m, uri[len(m.uri) :]
        return None

    def to_pod_path(self, uri: str) -> str:
        """Store URI (or a path already under a mount) -> path inside the pods."""
        uri = str(uri)
        if split_uri(uri) is None:
            if uri.startswith("/") and any(uri == m.path or uri.startswith(m.path + "/") for m in self.mounts):
                return posixpath.normpath(uri)
            raise UserError(
                f"{uri!r} is not a store URI on a mount; pass a URI under one of {[m.uri for m in self.mounts]} "
                f"(set the mounts in the preset's cluster.mounts or ${ENV_VAR})"
            )
        hit = self.find(uri)
        if hit is None:
            known = [m.uri for m in self.mounts] or "none configured"
            raise UserError(
                f"{uri!r} is outside every mounted bucket ({known}); add a mount for it to cluster.mounts or ${ENV_VAR}"
            )
        m, rel = hit
        rel = _clean_rel(rel, repr(uri))
        return posixpath.join(m.path, rel) if rel else m.path

    def volumes(self) -> tuple[list[dict], list[dict]]:
        """(pod ``volumes``, container ``volumeMounts``) for every mount, in a stable order."""
        volumes: dict[str, dict] = {}
        mounts = []
        for m in sorted(self.mounts, key=lambda m: m.path):
            volumes.setdefault(
                m.volume, {"name": m.volume, "persistentVolumeClaim": {"claimName": m.claim, "readOnly": m.read_only}}
            )
            vm = {"name": m.volume, "mountPath": m.path, "readOnly": m.read_only}
            if m.sub_path:
                vm["subPath"] = m.sub_path
            mounts.append(vm)
        return sorted(volumes.values(), key=lambda v: v["name"]), mounts

    def pod_annotations(self) -> dict[str, str]:
        """Annotations the mounts' CSI drivers need on every pod that mounts them."""
        out: dict[str, str] = {}
        for m in self.mounts:
            out.update(dict(m.pod_annotations))
        return dict(sorted(out.items()))


def _parse_entry(entry, source: str) -> Mount:
    if not isinstance(entry, dict):
        raise UserError(f"{source}: every entry must be a mapping with uri, claim and path; got {type(entry).__name__}")
    unknown = set(entry) - {"uri", "claim", "path", "readOnly", "subPath", "podAnnotations"}
    if unknown:
        raise UserError(
            f"{source}: unknown keys {sorted(unknown)} in entry {entry.get('uri')!r}; allowed: uri, claim, path, "
            "readOnly, subPath, podAnnotations"
        )
    uri, claim, path = (str(entry.get(k) or "") for k in ("uri", "claim", "path"))
    parts = split_uri(uri)
    if parts is None or not parts[1].strip("/"):
        raise UserError(f"{source}: uri {uri!r} must look like scheme://bucket[/prefix], for example gs://my-bucket")
    if not CLAIM_RE.match(claim):
        raise UserError(
            f"{source}: claim {claim!r} for {uri!r} is not a valid PersistentVolumeClaim name (lower-case DNS name)"
        )
    if not path.startswith("/") or posixpath.normpath(path) != path.rstrip("/") or path == "/":
        raise UserError(f"{source}: path {path!r} for {uri!r} must be a normalised absolute directory other than /")
    if any(path == r or path.startswith(r + "/") for r in RESERVED_PATHS):
        raise UserError(f"{source}: path {path!r} is reserved (shared memory); choose another mount path")
    read_only = entry.get("readOnly", False)
    if not isinstance(read_only, bool):
        raise UserError(f"{source}: readOnly for {uri!r} must be true or false")
    sub_path = entry.get("subPath")
    if sub_path is not None:
        sub_path = _clean_rel(str(sub_path), f"{source}: subPath for {uri!r}") or None
    ann = entry.get("podAnnotations") or {}
    if not isinstance(ann, dict) or not all(
        re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9][-A-Za-z0-9_.]{0,62}", str(k)) for k in ann
    ):
        raise UserError(f"{source}: podAnnotations for {uri!r} must map annotation names to string values")
    return Mount(
        uri=uri.rstrip("/"),
        claim=claim,
        path=path.rstrip("/"),
        read_only=read_only,
        sub_path=sub_path,
        pod_annotations=tuple(sorted((str(k), str(v)) for k, v in ann.items())),
    )
